"""A mixture-of-experts block's forward + backward time against a dense SwiGLU block with the
same active parameters, in one run (what the grouped matmul buys, and what routing costs).

Blocks (tokens [T, H], fp32 on the CPU, bf16 on CUDA; median of `--repeats` after two warm-up
runs, one process):

One thread on the CPU.

1. dense: a SwiGLU MLP of width top_k * I, the weights one token runs through in the MoE
   (the router's E x H is left out: under 1% here): the reference.
2. moe, grouped mm: `nanotron_models.moe.MoEBlock` (router, sort by expert, `torch._grouped_mm`,
   weighted combine, balance losses), random routing (near balanced).
3. moe, loop: the same block with the loop over experts (one matmul each; reads the counts on
   the host).
4. moe, skewed: grouped mm with the gate sending every token's first choice to expert 0.

Printed: each time and its ratio to dense.

    .venv/bin/python bench/moe_block.py [--tokens 4096] [--hidden 512] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanotron_models import Qwen2Config
from nanotron_models.blocks import MLP
from nanotron_models.moe import MoEBlock, MoEConfig
from nanotron_parallel.context import ParallelContext
from nanotron_parallel.tensor_parallel import TensorParallelLinearMode


def _config(args) -> Qwen2Config:
    moe = MoEConfig(num_experts=args.experts, top_k=args.top_k,
                    moe_intermediate_size=args.intermediate, router_aux_loss_coef=0.01)  # fmt: skip
    return Qwen2Config(hidden_size=args.hidden, intermediate_size=args.top_k * args.intermediate,
                       num_hidden_layers=1, num_attention_heads=8, moe_config=moe)  # fmt: skip


def _once(block, x, grouped: bool) -> float:
    """Seconds of one forward + backward."""
    if hasattr(block, "experts"):
        block.experts.use_grouped_mm = grouped
    for p in block.parameters():
        p.grad = None
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    block(x).float().square().mean().backward()
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _medians(cases, repeats: int) -> list[float]:
    """Each case's median over `repeats` rounds after two warm-up rounds; the cases take turns
    within a round, so a change of machine load falls on all of them alike."""
    times: list[list[float]] = [[] for _ in cases]
    for i in range(repeats + 2):
        for j, case in enumerate(cases):
            seconds = _once(*case)
            if i >= 2:
                times[j].append(seconds)
    return [statistics.median(t) for t in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    pc = ParallelContext()
    device = torch.device(pc.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)  # steadier on a shared machine; every block alike
    torch.manual_seed(0)
    config, mode = _config(args), TensorParallelLinearMode.ALL_REDUCE
    kw = {"device": device, "dtype": dtype}
    dense = MLP(config, pc.tp_group, mode, **kw)
    moe = MoEBlock(config, 0, pc.tp_group, mode, **kw)
    with torch.no_grad():
        for block in (dense, moe):
            for w in block.parameters():
                w.normal_(0.0, 0.05)
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype).requires_grad_()
    # a direction every token shares and the gate of expert 0 reads: its first choice
    direction = torch.nn.functional.normalize(torch.randn(args.hidden), dim=0).to(device, dtype)
    skewed = (x.detach() + 3 * direction).requires_grad_()
    skewed_moe = MoEBlock(config, 0, pc.tp_group, mode, **kw)
    skewed_moe.load_state_dict(moe.state_dict())
    with torch.no_grad():
        skewed_moe.router.weight[0] = 10 * direction
        first = skewed_moe.router(skewed.reshape(-1, args.hidden)).topk_idx[:, 0]
    names = ["dense (same active weights)", "moe, grouped mm", "moe, loop over experts",
             "moe, skewed to one expert"]  # fmt: skip
    cases = [(dense, x, True), (moe, x, True), (moe, x, False), (skewed_moe, skewed, True)]
    rows = list(zip(names, _medians(cases, args.repeats)))
    print(f"{args.tokens} tokens, hidden {args.hidden}, {args.experts} experts of "
          f"{args.intermediate}, top-{args.top_k}, {dtype} on {device.type}")  # fmt: skip
    print(f"skewed: {float((first == 0).float().mean()):.0%} of tokens choose expert 0 first")
    for name, seconds in rows:
        print(f"{name:30s} {seconds * 1e3:9.2f} ms  x{seconds / rows[0][1]:.2f}")
    pc.destroy()


if __name__ == "__main__":
    main()
