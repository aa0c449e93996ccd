"""Nanoset read throughput against a raw numpy memmap read of the same bytes, same order.

    .venv/bin/python bench/data_throughput.py [--nanoset DIR] [--seq 1024] [--mbs 8]

Without --nanoset it writes a synthetic 64M-token Nanoset to a temporary folder. Both readers
produce the same int64 [mbs, seq] input/label tensors (checked by a checksum) in the same
shuffled sample order; the Nanoset side goes through TrainData (shuffle, blend, collate into
torch tensors, label mask), the raw side reads precomputed offsets from an np.memmap. The
two alternate in short chunks and each keeps its fastest chunk, so the load of a shared
machine cancels out. Aim: ratio >= 0.8.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nanotron_train.data import DatasetSpec, Nanoset, StageSpec, TrainData
from nanotron_train.data.sampler import ShuffledSamples
from nanotron_train.data.testing import make_id_nanoset

SEED = 1234


def synthetic(folder: Path, num_tokens: int) -> Path:
    lengths = np.full(num_tokens // 4096, 4096)
    return make_id_nanoset(folder, lengths.tolist(), low=1, high=50000, vocab_size=50257)


class NanosetReader:
    def __init__(self, folder: str, seq: int, mbs: int):
        self.data = TrainData([StageSpec("bench", 1, DatasetSpec(folder), SEED)],
                              sequence_length=seq, micro_batch_size=mbs,
                              batch_accumulation_per_replica=1, dp_rank=0, dp_size=1,
                              tokenizer_path=None, cache_dir="", model_vocab_size=1 << 20)  # fmt: skip
        self.step = 0
        self.check = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            mb = self.data.micro_batches(self.step)[0]
            self.check += int(mb["input_ids"][:, -1].sum()) + int(mb["label_ids"][:, -1].sum())


class RawReader:
    def __init__(self, folder: str, seq: int, mbs: int, total_steps: int):
        ns = Nanoset(folder)  # only for the dtype and sample count; reads go through `mm`
        self.mm = np.memmap(Path(folder) / "tokens.bin", dtype=ns.dtype, mode="r")
        # The order is computed up front: the reference pays for no shuffle logic at all.
        order = ShuffledSamples(ns.num_samples(seq), SEED, 0, "raw", log=False)
        ids = np.concatenate([order.sample_ids(j, 1) for j in range(total_steps * mbs)])
        self.starts = (ids * seq).tolist()
        self.seq, self.mbs = seq, mbs
        self.j = 0
        self.check = 0

    def run(self, steps: int) -> None:
        mm, n = self.mm, self.seq + 1
        for _ in range(steps):
            buf = np.empty((self.mbs, n), dtype=np.int64)
            for row in range(self.mbs):
                start = self.starts[self.j]
                buf[row] = mm[start : start + n]
                self.j += 1
            inputs = torch.from_numpy(buf[:, :-1].copy())
            labels = torch.from_numpy(buf[:, 1:].copy())
            self.check += int(inputs[:, -1].sum()) + int(labels[:, -1].sum())


def fastest_chunk(reader, steps: int) -> float:
    t0 = time.perf_counter()
    reader.run(steps)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nanoset", default=None)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--chunk-steps", type=int, default=20)
    p.add_argument("--chunks", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.nanoset or str(synthetic(Path(tmp) / "bench", 64 << 20))
        total = args.chunk_steps * args.chunks
        ours, raw = (
            NanosetReader(folder, args.seq, args.mbs),
            RawReader(folder, args.seq, args.mbs, total),
        )
        np.asarray(raw.mm).sum()  # warm the page cache for both
        best_ours = best_raw = float("inf")
        for _ in range(args.chunks):
            best_raw = min(best_raw, fastest_chunk(raw, args.chunk_steps))
            best_ours = min(best_ours, fastest_chunk(ours, args.chunk_steps))
        assert ours.check == raw.check, "the two readers read different samples"
    samples = args.chunk_steps * args.mbs
    rate_ours, rate_raw = samples / best_ours, samples / best_raw
    print(
        f"sequence_length {args.seq}, micro_batch_size {args.mbs}, {total * args.mbs} samples each"
    )
    print(
        f"nanoset (TrainData)  {rate_ours:10.0f} samples/s  ({rate_ours * args.seq / 1e6:.1f} M tok/s)"
    )
    print(
        f"raw numpy memmap     {rate_raw:10.0f} samples/s  ({rate_raw * args.seq / 1e6:.1f} M tok/s)"
    )
    print(f"ratio nanoset/raw    {rate_ours / rate_raw:.3f}   (aim >= 0.8)")


if __name__ == "__main__":
    main()
