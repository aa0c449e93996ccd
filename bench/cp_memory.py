"""Context parallelism: memory per rank for each cp attention (all-gather, ring, Ulysses) at
cp = 2 and 4 against cp = 1, and the longest sequence each fits in a fixed budget per rank.

1. Attention-time peak bytes. One attention (8 heads, fp32, micro-batch 1) forward and
   backward on this rank's share of a sequence, while a dispatch mode records every tensor
   storage alive at each operation (the local q, k, v and output gradient included; each
   storage once, by a weak reference): the peak is what the attention needs at its worst
   moment (gathered or in-flight K/V, block outputs, gradients, the kernel's own buffers).
   Printed per cp and choice: the largest rank's peak and its ratio to cp = 1's (aim for the
   ring: 2/cp + 10%). Same run: the peak at three sequence lengths gives a quadratic fit, and
   from it the longest sequence whose attention fits `--budget-mib` per rank.
2. Saved activations. A small Llama's forward on this rank's share (the pipeline's
   ActivationTracker: bytes autograd keeps for the backward, parameters excluded), per cp
   and choice, against cp = 1 (aim: 1/cp + 10%).

    .venv/bin/python bench/cp_memory.py [--seq 2048] [--kv-heads 8] [--budget-mib 64]

Everything runs in one process per rank (gloo on the CPU); cp = 2 and cp = 4 are one launch
each.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nanotron_parallel.testing import run_distributed

CHOICES = ("allgather", "ring", "ulysses")
HEADS, HEAD_DIM = 8, 32


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of all storages alive after each op (tracked ones only: those
    registered or made by an op under this mode)."""

    def __init__(self, *tensors: torch.Tensor):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        for t in tensors:
            self._track(t)
        self._update()

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in self.refs:
            self.refs[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())

    def _update(self) -> None:
        for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
            del self.refs[key]
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._update()  # freed storages go first: their addresses may be reused
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self._update()
        return out


def attention_peak(seq: int, kv_heads: int, choice: str, pc) -> int:
    """Peak live bytes of one cp attention's forward + backward on this rank."""
    from functools import partial

    from nanotron_models.attention import attention
    from nanotron_parallel.context_parallel import causal_kernel, context_parallel_attention

    local = seq // pc.cp_size
    g = torch.Generator().manual_seed(pc.cp_rank)
    q = torch.randn(local, 1, HEADS, HEAD_DIM, generator=g).requires_grad_()
    k = torch.randn(local, 1, kv_heads, HEAD_DIM, generator=g).requires_grad_()
    v = torch.randn(local, 1, kv_heads, HEAD_DIM, generator=g).requires_grad_()
    grad = torch.randn(local, 1, HEADS, HEAD_DIM, generator=g)
    kernel = causal_kernel(partial(attention, backend="sdpa"))
    with LiveBytes(q, k, v, grad) as tracker:
        out = context_parallel_attention(q, k, v, pc.cp_group, kernel, method=choice)
        out.backward(grad)
        del out
        tracker._update()
    return tracker.peak


def model_config(hidden: int, layers: int, seq: int, kv_heads: int):
    from nanotron_models.config import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        vocab_size=512,
        max_position_embeddings=seq,
        tie_word_embeddings=True,
    )


def saved_bytes(seq: int, hidden: int, layers: int, kv_heads: int, choice: str, pc) -> int:
    """Bytes this rank's forward of a small Llama saves for backward."""
    from nanotron_models.model import build_llama
    from nanotron_parallel.context_parallel import split_batch
    from nanotron_parallel.pipeline.step import ActivationTracker

    stage = build_llama(model_config(hidden, layers, seq, kv_heads), pc, seed=1)
    stage.set_context_parallel(pc.cp_group, pc.cp_size, None, choice)
    ids = torch.randint(0, 512, (1, seq + 1), generator=torch.Generator().manual_seed(2))
    batch = {
        "input_ids": ids[:, :-1],
        "label_ids": ids[:, 1:],
        "label_mask": torch.ones(1, seq, dtype=torch.bool),
    }
    tracker = ActivationTracker(stage, measure_bytes=True)
    loss = tracker.forward(stage, None, split_batch(batch, pc.cp_rank, pc.cp_size), 0)
    loss.backward()  # the graph is whole: everything counted is what the backward reads
    return tracker.stats.peak_saved_activation_bytes


def measure_rank(seqs: list[int], hidden: int, layers: int, kv_heads: int) -> dict:
    """On every rank of a launch (or alone, cp = 1): both measures for every choice."""
    from nanotron_parallel.context import ParallelContext

    torch.set_num_threads(1)
    pc = ParallelContext(cp=int(os.environ.get("WORLD_SIZE", "1")))
    choices = CHOICES if pc.cp_size > 1 else ("allgather",)  # cp = 1: the plain kernel
    try:
        return {
            c: {
                "peak": [attention_peak(s, kv_heads, c, pc) for s in seqs],
                "saved": saved_bytes(seqs[-1], hidden, layers, kv_heads, c, pc),
            }
            for c in choices
        }
    finally:
        pc.destroy()


def measure(cp: int, *args) -> dict:
    """The largest rank's figures at context-parallel degree `cp`."""
    if cp == 1:
        return measure_rank(*args)
    ranks = run_distributed(measure_rank, cp, *args, timeout=1800)
    return {
        c: {
            "peak": [max(r[c]["peak"][i] for r in ranks) for i in range(len(args[0]))],
            "saved": max(r[c]["saved"] for r in ranks),
        }
        for c in ranks[0]
    }


def longest_fitting(seqs: list[int], peaks: list[int], budget: int, multiple: int) -> int:
    """The longest sequence (a multiple of `multiple`) whose fitted peak is within budget."""
    a, b, c = np.polyfit(np.array(seqs, dtype=float), np.array(peaks, dtype=float), 2)
    roots = [r.real for r in np.roots([a, b, c - budget]) if abs(r.imag) < 1e-9 and r.real > 0]
    return int(min(roots) // multiple * multiple) if roots else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048, help="the longest measured sequence")
    parser.add_argument("--kv-heads", type=int, default=8, help="of 8 query heads")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--budget-mib", type=float, default=64.0)
    args = parser.parse_args()
    seqs = [args.seq // 4, args.seq // 2, args.seq]
    rest = (seqs, args.hidden, args.layers, args.kv_heads)
    results = {cp: measure(cp, *rest) for cp in (1, 2, 4)}
    base = results[1]["allgather"]
    mib, budget = 2**20, args.budget_mib * 2**20
    print(
        f"attention: {HEADS} heads / {args.kv_heads} kv heads of {HEAD_DIM}, fp32, "
        f"micro-batch 1, sequence {args.seq}; forward + backward, largest rank"
    )
    print(f"cp=1: peak {base['peak'][-1] / mib:8.2f} MiB (reference)")
    for cp in (2, 4):
        for choice, res in results[cp].items():
            ratio = res["peak"][-1] / base["peak"][-1]
            aim = f" (aim 2/cp + 10% = {2 / cp + 0.1:.3f}: " if choice == "ring" else ""
            met = ("met)" if ratio <= 2 / cp + 0.1 else "MISSED)") if aim else ""
            print(
                f"cp={cp} {choice:9}: peak {res['peak'][-1] / mib:8.2f} MiB, ratio {ratio:.3f}{aim}{met}"
            )
    print(
        f"longest sequence whose attention fits {args.budget_mib:g} MiB per rank (fit over {seqs}):"
    )
    print(f"cp=1          : {longest_fitting(seqs, base['peak'], budget, 2):8d}")
    for cp in (2, 4):
        for choice, res in results[cp].items():
            print(f"cp={cp} {choice:9}: {longest_fitting(seqs, res['peak'], budget, 2 * cp):8d}")
    print(
        f"saved activations of a {args.layers}-layer Llama (hidden {args.hidden}), sequence "
        f"{args.seq}: cp=1 {base['saved'] / mib:.2f} MiB"
    )
    for cp in (2, 4):
        for choice, res in results[cp].items():
            ratio = res["saved"] / base["saved"]
            verdict = "met" if ratio <= 1 / cp + 0.1 else "MISSED"
            print(
                f"cp={cp} {choice:9}: {res['saved'] / mib:8.2f} MiB, ratio {ratio:.3f} "
                f"(aim 1/cp + 10% = {1 / cp + 0.1:.3f}: {verdict})"
            )


if __name__ == "__main__":
    main()
