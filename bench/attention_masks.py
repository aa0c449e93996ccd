"""Attention cost with document masking against full causal attention, on a packed batch of
short documents (what `_use_doc_masking` / `flex_attention_mask: document` buys).

One attention layer's forward, then forward + backward (q [S, b, heads, d], grouped kv heads,
fp32 on the CPU, bf16 on CUDA), timed as the median of `--repeats` after two warm-up runs, in
one process (PyTorch has no flex backward on the CPU: there flex is timed forward only):

1. causal: the ordinary kernel with no document mask (`nanotron_models.attention`, SDPA's
   causal path): the reference.
2. documents, flex: `nanotron_models.masks` with the document mask through compiled flex
   attention, which skips the 128x128 blocks the mask empties (a packed batch of documents of
   length l keeps about l/S of the causal blocks), on a block mask built once (its build
   time is printed apart). Its compile is not timed.
3. documents, sdpa: the same mask as an explicit boolean mask through SDPA (what the CPU path
   of training runs): it computes every score and masks them, so it saves nothing.

Printed: each time, its ratio to causal, and the fraction of non-empty blocks of the block mask.

    .venv/bin/python bench/attention_masks.py [--seq 4096] [--doc-len 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanotron_models.attention import attention
from nanotron_models.masks import AttentionMask, _compiled_flex, masked_attention

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _inputs(seq: int, batch: int, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(seq, batch, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(seq, batch, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(seq, batch, KV_HEADS, HEAD_DIM, generator=gen)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


def _once(fn, inputs, backward: bool) -> float:
    """Seconds of one forward (and backward)."""
    for t in inputs:
        t.grad = None
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = fn(*(t if backward else t.detach() for t in inputs))
    if backward:
        out.backward(torch.ones_like(out))
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _medians(rows: dict, inputs, repeats: int, backward: bool) -> dict[str, float]:
    """Median seconds per row, the rows interleaved round by round (a shared machine's load
    then weighs on every row alike); two warm-up rounds first (the first compiles flex)."""
    times: dict[str, list[float]] = {name: [] for name in rows}
    for round_ in range(repeats + 2):
        for name, fn in rows.items():
            seconds = _once(fn, inputs, backward)
            if round_ >= 2:
                times[name].append(seconds)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--doc-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq = args.seq
    positions = (torch.arange(seq) % args.doc_len).expand(args.batch, seq).to(device)
    docs = (positions == 0).cumsum(dim=1)
    mask = AttentionMask(docs, None)
    index = torch.arange(seq, device=device)
    inputs = _inputs(seq, args.batch, device, dtype)
    backend = "sdpa" if device.type == "cpu" else "auto"
    from torch.nn.attention.flex_attention import create_block_mask

    start = time.perf_counter()
    block = create_block_mask(
        mask.mask_mod(index, index), args.batch, None, seq, seq, device=device
    )
    build_ms = (time.perf_counter() - start) * 1e3
    flex = _compiled_flex()

    def flex_kernel(q, k, v):  # the kernel alone, on the block mask built above
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        return flex(qb, kb, vb, block_mask=block, enable_gqa=True).permute(2, 0, 1, 3)

    rows = {
        "causal": lambda q, k, v: attention(q, k, v, backend),
        "documents, flex": flex_kernel,
        "documents, sdpa": lambda q, k, v: masked_attention(q, k, v, index, index, mask, "sdpa"),
    }
    print(
        f"device {device.type}, {dtype}, seq {seq}, batch {args.batch}, documents of "
        f"{args.doc_len} tokens, {HEADS} heads / {KV_HEADS} kv heads of {HEAD_DIM}; "
        f"flex block mask keeps {1 - block.sparsity() / 100:.3f} of its blocks, built in "
        f"{build_ms:.0f} ms (once per micro-batch and mask in training; not timed below)"
    )
    # PyTorch has no flex backward on the CPU: there flex is compared on the forward alone.
    for label, backward in (("forward", False), ("forward+backward", True)):
        timed = {
            name: fn
            for name, fn in rows.items()
            if not (backward and device.type == "cpu" and "flex" in name)
        }
        medians = _medians(timed, inputs, args.repeats, backward)
        for name in rows:
            if name not in medians:
                print(f"{label:16s} {name:16s}  (no flex backward on the CPU)")
                continue
            ratio = medians[name] / medians["causal"]
            print(
                f"{label:16s} {name:16s} {medians[name] * 1e3:8.1f} ms   ratio to causal {ratio:6.3f}"
            )


if __name__ == "__main__":
    main()
