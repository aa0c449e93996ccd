"""Checkpoint save/load throughput against plain sequential file I/O on the same disk.

    .venv/bin/python bench/checkpoint_io.py [--hidden 512] [--layers 6] [--repeats 2] [--dir PATH]

Builds a single-process Llama (~35M parameters: ~140 MB of weights plus ~280 MB of Adam
moments) and takes one training step so the optimizer state exists. Then, alternating, best of
`repeats`:
  * save: save_checkpoint (safetensors shards, sha256 of every byte, fsync, rename) vs writing
    the same number of bytes to one file in the same folder with write + fsync;
  * load: load_checkpoint (size and sha256 verified, tensors copied into the model and Adam)
    vs reading that many bytes back from one file. Before every read the files' pages are
    dropped from the page cache (posix_fadvise DONTNEED), so both read from the disk.
Prints GB/s of each and the two ratios checkpoint / plain (aim: >= 0.7).

Then the training stall per save, `checkpoints.async_save` vs a synchronous save (aim: async
<= 0.2 x sync): the sync stall is the whole save; the async stall is what the training thread
waits for, the host copy of the state plus, at the next save `--steps-between` steps later,
whatever of the previous background write is still unfinished.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

CHUNK = 16 * 2**20


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_write(path: Path, data: bytes) -> float:
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        view = memoryview(data)
        for lo in range(0, len(view), CHUNK):
            f.write(view[lo : lo + CHUNK])
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def plain_read(path: Path, size: int) -> float:
    drop_cache([path])
    buf = bytearray(size)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < size:
            pos += f.readinto(view[pos : pos + CHUNK])
    return time.perf_counter() - t0


def build(hidden: int, layers: int, root: Path):
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    raw = {
        "general": {"project": "bench", "run": "ckpt-io", "seed": 1},
        "model": {
            "model_config": {
                "hidden_size": hidden, "intermediate_size": hidden * 8 // 3, "num_hidden_layers": layers,
                "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000,
                "max_position_embeddings": 64,
            },
            "dtype": "float32",
        },
        "tokens": {"sequence_length": 32, "micro_batch_size": 1, "batch_accumulation_per_replica": 1, "train_steps": 1},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-4}},
        "checkpoints": {"checkpoints_path": str(root / "ckpt"), "save_final_state": False},
    }  # fmt: skip
    cfg = config_from_dict(raw, "bench", world_size=1)
    pc = ParallelContext()
    trainer = Trainer(cfg, pc, stream=io.StringIO())
    trainer.train_step()
    return trainer, cfg, pc


def stalls(trainer, cfg, pc, root: Path, repeats: int, between: int) -> tuple[float, float]:
    """Best-of-`repeats` seconds the training thread spends per save: sync, then async."""
    from nanotron_train.checkpoints import save_checkpoint
    from nanotron_train.checkpoints.async_save import AsyncCheckpointer
    from nanotron_train.fault.coordination import shared_store

    sync = []
    for _ in range(repeats):
        trainer.train_step()
        t0 = time.perf_counter()
        save_checkpoint(root / "sync", trainer.state, cfg, pc, trainer.zero_stage)
        sync.append(time.perf_counter() - t0)
    writer = AsyncCheckpointer(root / "async", pc, shared_store("bench-async"), 600.0)
    stalled = []
    for _ in range(repeats):
        trainer.train_step()
        t0 = time.perf_counter()
        writer.start(trainer.state, cfg, trainer.zero_stage)  # the host copy
        stall = time.perf_counter() - t0
        for _ in range(between):
            trainer.train_step()
        t0 = time.perf_counter()
        writer.wait()  # what the next save would wait for
        stalled.append(stall + time.perf_counter() - t0)
    return min(sync), min(stalled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--steps-between", type=int, default=4, help="training steps between two async saves"
    )
    parser.add_argument(
        "--dir", default=None, help="folder on the disk to measure (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from nanotron_train.checkpoints import load_checkpoint, read_metadata, save_checkpoint

    root = Path(tempfile.mkdtemp(prefix="ckpt-io-", dir=args.dir))
    try:
        trainer, cfg, pc = build(args.hidden, args.layers, root)
        best = {"save": 1e9, "load": 1e9, "write": 1e9, "read": 1e9}
        nbytes = 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            folder = save_checkpoint(root / "ckpt", trainer.state, cfg, pc, trainer.zero_stage)
            best["save"] = min(best["save"], time.perf_counter() - t0)
            meta = read_metadata(folder)
            files = [folder / f["path"] for f in meta["files"]]
            nbytes = sum(f["size"] for f in meta["files"])
            plain = root / "plain.bin"
            best["write"] = min(best["write"], plain_write(plain, os.urandom(nbytes)))
            best["read"] = min(best["read"], plain_read(plain, nbytes))
            drop_cache(files)
            t0 = time.perf_counter()
            load_checkpoint(folder, trainer.state, cfg, pc, trainer.zero_stage)
            best["load"] = min(best["load"], time.perf_counter() - t0)
            plain.unlink()
        gbs = {k: nbytes / v / 1e9 for k, v in best.items()}
        print(f"checkpoint: {nbytes / 1e6:.0f} MB in {len(files)} files")
        print(
            f"save  {gbs['save']:.3f} GB/s   plain write+fsync {gbs['write']:.3f} GB/s   ratio {gbs['save'] / gbs['write']:.2f}"
        )
        print(
            f"load  {gbs['load']:.3f} GB/s   plain read        {gbs['read']:.3f} GB/s   ratio {gbs['load'] / gbs['read']:.2f}"
        )
        sync_stall, async_stall = stalls(trainer, cfg, pc, root, args.repeats, args.steps_between)
        print(
            f"stall per save: sync {sync_stall * 1e3:.0f} ms   async {async_stall * 1e3:.0f} ms   "
            f"ratio async/sync {async_stall / sync_stall:.3f}"
        )
        trainer.close()
        pc.destroy()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
