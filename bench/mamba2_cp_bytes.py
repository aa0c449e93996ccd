"""Context parallel for Mamba-2: bytes each cp rank receives per layer, counted in the
collectives, against the formula (mixers.mamba2_cp.cp_bytes_per_layer), at a real mixer's size.

One Mamba-2 2.7B mixer (hidden 2560, 80 heads of 64, 1 group, state 128, conv kernel 4; bf16
activations, fp32 states), micro-batch 1, at cp = 2 and 4 and two sequence lengths: every rank
runs `context_parallel_forward` and a backward while the p2p batches, the all-gather and the
reduce-scatter of nanotron_parallel.context_parallel.state_passing count the bytes that
reach it. For scale, the bytes an all-gather attention layer of the same width (8 kv heads of
128, bf16) receives per rank, from its formula (cp-1)/cp * S * b * 2 * kv * d * e.

    .venv/bin/python bench/mamba2_cp_bytes.py [--seqs 64 512]
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch
import torch.distributed as dist

from nanotron_parallel.testing import run_distributed

DIMS = dict(hidden_size=2560, num_heads=80, head_dim=64, n_groups=1, state_size=128)
KV_HEADS, KV_DIM = 8, 128


@contextmanager
def counting(received: dict[str, int]):
    """Count the bytes reaching this rank through state_passing's collectives."""
    from nanotron_parallel.context_parallel import state_passing as sp

    gather, scatter, p2p = sp._all_gather_tensor, sp._reduce_scatter_tensor, dist.batch_isend_irecv

    def counted_gather(out, inp, group=None):
        received["states"] += (out.numel() - inp.numel()) * out.element_size()
        return gather(out, inp, group=group)

    def counted_scatter(out, inp, group=None):
        received["states"] += (inp.numel() - out.numel()) * out.element_size()
        return scatter(out, inp, group=group)

    def counted_p2p(ops):
        for op in ops:
            if op.op is dist.irecv:
                received["halo"] += op.tensor.numel() * op.tensor.element_size()
        return p2p(ops)

    sp._all_gather_tensor, sp._reduce_scatter_tensor = counted_gather, counted_scatter
    dist.batch_isend_irecv = counted_p2p
    try:
        yield
    finally:
        sp._all_gather_tensor, sp._reduce_scatter_tensor = gather, scatter
        dist.batch_isend_irecv = p2p


def worker(seqs: list[int]) -> list[dict]:
    from nanotron_models.mixers import Mamba2Dims, Mamba2Mixer
    from nanotron_models.mixers.mamba2_cp import context_parallel_forward, cp_bytes_per_layer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    dims = Mamba2Dims(**DIMS)
    mixer = Mamba2Mixer(dims, dtype=torch.bfloat16)
    rows = []
    for seq in seqs:
        x = torch.randn(1, seq // cp, dims.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        fwd, bwd = {"halo": 0, "states": 0}, {"halo": 0, "states": 0}
        with counting(fwd):
            out = context_parallel_forward(mixer, x, None, native_reduce_scatter=True)
        with counting(bwd):
            out.float().square().mean().backward()
        rows.append({
            "seq": seq, "rank": rank, "forward": fwd, "backward": bwd,
            "formula": cp_bytes_per_layer(dims, 1, rank, cp, torch.bfloat16),
            "formula_bwd": cp_bytes_per_layer(dims, 1, rank, cp, torch.bfloat16, backward=True),
        })  # fmt: skip
    dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 512])
    args = parser.parse_args()
    print("cp  seq   rank  fwd halo  fwd states  bwd halo  bwd states  formula (halo + states)")
    for cp in (2, 4):
        by_rank = run_distributed(worker, cp, args.seqs, timeout=600)
        for row in sorted((r for rows in by_rank for r in rows), key=lambda r: r["seq"]):
            f, b, want = row["forward"], row["backward"], row["formula"]
            same = (f["halo"], f["states"]) == (want.halo, want.states) and (
                b["halo"],
                b["states"],
            ) == (row["formula_bwd"].halo, row["formula_bwd"].states)
            print(
                f"{cp:<3} {row['seq']:<5} {row['rank']:<5} {f['halo']:>8}  {f['states']:>10}  "
                f"{b['halo']:>8}  {b['states']:>10}  {want.halo} + {want.states} "
                f"{'== counted' if same else '!= counted'}"
            )
    print("\nall-gather attention of the same width (formula), bytes received per rank:")
    for cp in (2, 4):
        for seq in (4096, 32768):
            kv = (cp - 1) * (seq // cp) * 2 * KV_HEADS * KV_DIM * 2
            print(f"cp={cp} seq={seq}: {kv}")


if __name__ == "__main__":
    main()
