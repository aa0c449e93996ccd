"""The Gated DeltaNet mixer against attention and Mamba-2 of the same width, and its
context-parallel bytes against the formula.

1. Forward + backward time and peak memory of one mixer layer (fp32, micro-batch 1, the
   PyTorch code paths: the CPU) at sequence lengths 512..8192, as ratios to an attention layer
   in the same run: the Gated DeltaNet mixer (Qwen3-Next's shape scaled to the width: key
   heads = value heads / 2, head dims 64), a causal attention layer (q/k/v/o projections,
   PyTorch's scaled_dot_product_attention, 8 heads of 64, 2 kv heads) and the Mamba-2 mixer
   (expand 2, heads of 64, state 128, one group). Time: the process's CPU time (one thread:
   what the op costs, not how long a loaded machine made it wait), the least of `--repeats`
   rounds after a warm-up, the three layers taking turns in each round. Memory: the peak of the bytes of all tensors alive during the forward and backward
   (bench/cp_memory.py's LiveBytes; the weights excluded, their gradients included), measured
   in a separate pass since tracking slows every op.
2. Bytes one cp rank receives per layer and micro-batch (forward and backward), counted in
   state_passing's collectives, against `gated_deltanet_cp.cp_bytes_per_layer` (the formula
   of its docstring), at Qwen3-Next-80B's mixer size (hidden 2048, 16 key heads and 32 value
   heads of 128, conv kernel 4; bf16 activations, fp32 states), cp = 2 and 4, one gloo launch
   each; for scale, the bytes an all-gather attention layer of Qwen3-Next's (2 kv heads of
   256) receives, from its formula (cp-1)/cp * S * 2 * kv * d * e.

    .venv/bin/python bench/gated_deltanet_mixer.py [--seqs 512 1024 2048 4096 8192]
        [--hidden 512] [--repeats 2] [--threads 1] [--cp-seq 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from cp_memory import LiveBytes  # bench/ is the script's folder, so on sys.path
from mamba2_cp_bytes import counting
from torch import nn

from nanotron_models.mixers import Mamba2Dims, Mamba2Mixer
from nanotron_models.mixers.gated_deltanet import GatedDeltaNetDims, GatedDeltaNetMixer
from nanotron_parallel.testing import run_distributed

QWEN3_NEXT = dict(hidden_size=2048, num_key_heads=16, num_value_heads=32, key_head_dim=128,
                  value_head_dim=128, conv_kernel=4)  # fmt: skip


class Attention(nn.Module):
    """A causal GQA attention layer: the reference a linear-attention layer replaces."""

    def __init__(self, hidden: int, heads: int = 8, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.dim, bias=False)
        self.o_proj = nn.Linear(heads * self.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.dim, *(2 * [self.kv_heads * self.dim])], -1)
        q, k, v = (t.view(b, s, -1, self.dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def mixers(hidden: int) -> dict[str, nn.Module]:
    gdn = GatedDeltaNetDims(hidden, hidden // 128, hidden // 64, 64, 64)
    mamba = Mamba2Dims(hidden, 2 * hidden // 64, 64, 1, 128)
    return {"attention": Attention(hidden), "gated_deltanet": GatedDeltaNetMixer(gdn),
            "mamba2": Mamba2Mixer(mamba)}  # fmt: skip


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    layer(x).backward(grad)


def inputs(seq: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, hidden, generator=g).requires_grad_()
    return x, torch.randn(1, seq, hidden, generator=g)


def cpu_seconds(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    start = time.process_time()
    fwd_bwd(layer, x, grad)
    return time.process_time() - start


def peak_bytes(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> int:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with LiveBytes(x, grad) as tracker:
        fwd_bwd(layer, x, grad)
        tracker._update()
    layer.zero_grad(set_to_none=True)
    return tracker.peak


def measure(layers: dict[str, nn.Module], seq: int, hidden: int, repeats: int) -> dict:
    """name -> (least CPU seconds of a forward + backward, peak live bytes)."""
    x, grad = inputs(seq, hidden)
    for layer in layers.values():
        fwd_bwd(layer, x, grad)  # warm-up
    times = {name: [] for name in layers}
    for _ in range(repeats):  # the layers take turns: a load spike hits them alike
        for name, layer in layers.items():
            times[name].append(cpu_seconds(layer, x, grad))
    return {name: (min(times[name]), peak_bytes(layer, x, grad)) for name, layer in layers.items()}


def compare(seqs: list[int], hidden: int, repeats: int) -> None:
    layers = mixers(hidden)
    print(f"hidden {hidden}, fp32, micro-batch 1, {torch.get_num_threads()} thread(s)")
    print("seq    | CPU s: attention   GDN      Mamba-2 | GDN/attn Mamba-2/attn GDN/Mamba-2 "
          "| peak MiB: attention GDN    Mamba-2 | GDN/attn GDN/Mamba-2")  # fmt: skip
    for seq in seqs:
        got = measure(layers, seq, hidden, repeats)
        (ta, ma), (tg, mg), (tm, mm) = got["attention"], got["gated_deltanet"], got["mamba2"]
        mib = 2**20
        print(f"{seq:6d} | {ta:9.3f} {tg:8.3f} {tm:8.3f} | {tg / ta:8.2f} {tm / ta:12.2f} "
              f"{tg / tm:11.2f} | {ma / mib:9.1f} {mg / mib:6.1f} {mm / mib:8.1f} | "
              f"{mg / ma:8.2f} {mg / mm:11.2f}", flush=True)  # fmt: skip


# ---- context-parallel bytes ------------------------------------------------------------------


def cp_worker(seq: int) -> dict:
    from nanotron_models.mixers.gated_deltanet_cp import (
        context_parallel_forward,
        cp_bytes_per_layer,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    dims = GatedDeltaNetDims(**QWEN3_NEXT)
    mixer = GatedDeltaNetMixer(dims, dtype=torch.bfloat16)
    x = torch.randn(1, seq // cp, dims.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    fwd, bwd = {"halo": 0, "states": 0}, {"halo": 0, "states": 0}
    with counting(fwd):
        out = context_parallel_forward(mixer, x, None, native_reduce_scatter=True)
    with counting(bwd):
        out.float().square().mean().backward()
    formula = [cp_bytes_per_layer(dims, 1, rank, cp, torch.bfloat16, backward=b)
               for b in (False, True)]  # fmt: skip
    dist.destroy_process_group()
    return {"rank": rank, "forward": fwd, "backward": bwd, "formula": formula}


def cp_bytes(seq: int) -> None:
    print(f"\nQwen3-Next-80B mixer, bf16, micro-batch 1, sequence {seq}: bytes received per "
          "cp rank and layer (counted / formula)")  # fmt: skip
    for cp in (2, 4):
        for row in run_distributed(cp_worker, cp, seq, timeout=600):
            for way, f in zip(("forward", "backward"), row["formula"]):
                got = row[way]
                print(f"cp={cp} rank {row['rank']} {way:8s}: halo {got['halo']:>9,} / "
                      f"{f.halo:>9,} = {got['halo'] / f.halo:.3f}; states {got['states']:>11,} "
                      f"/ {f.states:>11,} = {got['states'] / f.states:.3f}")  # fmt: skip
        for s in (4096, 32768):  # Qwen3-Next's attention layers: 2 kv heads of 256
            kv = (cp - 1) / cp * s * 2 * 2 * 256 * 2
            print(f"  all-gather attention K/V (2 kv heads of 256, bf16) at S = {s}: {kv:,.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cp-seq", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    compare(args.seqs, args.hidden, args.repeats)
    cp_bytes(args.cp_seq)


if __name__ == "__main__":
    main()
