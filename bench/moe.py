"""Mixture of experts and expert parallelism: three figures, each a ratio measured in one run.

1. Block time: a MoE block's forward + backward (E experts, top-k, SwiGLU experts of
   intermediate I, grouped matmul over the tokens sorted by expert, one process) against a
   dense SwiGLU MLP with the same active parameters per token (intermediate k * I), on the
   same [S, b, H] input; the median of `--repeats` after two warm-ups, the two interleaved.
2. All-to-all bytes: at ep=2 (gloo, two processes) one dispatch + combine of T tokens, the
   bytes every `all_to_all_single` of the dispatcher sends (rows out, outputs back, and the
   counts exchange apart) against the formula T x top_k x H x dtype bytes per direction.
3. Expert memory: a Qwen2 MoE trains two steps at dp=4 with ep = 1, 2, 4 (four processes,
   ZeRO-1); each rank's expert bytes (parameters, gradient buffers, Adam moments of its expert
   pieces) against the formula  layers x (E / ep) x 3 H I x (4 + 4 + 8 / edp)  bytes (fp32
   weights and gradients, the moments sharded over edp = dp / ep).

    .venv/bin/python bench/moe.py [--hidden 256 --experts 8 --top-k 2 --moe-inter 256
        --seq 512 --batch 2 --repeats 5]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from types import SimpleNamespace

import torch

from nanotron_parallel.testing import run_distributed


def _moe_block(args, pc):
    from nanotron_models.moe import MoEBlock
    from nanotron_models.moe.config import MoEConfig
    from nanotron_parallel.tensor_parallel import TensorParallelLinearMode

    moe = MoEConfig(num_experts=args.experts, top_k=args.top_k,
                    moe_intermediate_size=args.moe_inter, router_aux_loss_coef=0.01)  # fmt: skip
    config = SimpleNamespace(hidden_size=args.hidden, moe_config=moe)
    block = MoEBlock(config, 0, pc.tp_group, TensorParallelLinearMode.ALL_REDUCE)
    return _filled(block)


def _dense_mlp(args, pc):
    from nanotron_models.blocks import MLP
    from nanotron_parallel.tensor_parallel import TensorParallelLinearMode

    size = SimpleNamespace(hidden_size=args.hidden, intermediate_size=args.top_k * args.moe_inter)
    return _filled(MLP(size, pc.tp_group, TensorParallelLinearMode.ALL_REDUCE))


@torch.no_grad()
def _filled(module):
    gen = torch.Generator().manual_seed(0)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return module


def _once(module, x) -> float:
    x.grad = None
    start = time.perf_counter()
    module(x).square().mean().backward()
    return time.perf_counter() - start


def block_times(args) -> None:
    from nanotron_parallel.context import ParallelContext

    pc = ParallelContext()
    try:
        rows = {"moe": _moe_block(args, pc), "dense": _dense_mlp(args, pc)}
        x = torch.randn(args.seq, args.batch, args.hidden).requires_grad_()
        times: dict[str, list[float]] = {k: [] for k in rows}
        for round_ in range(args.repeats + 2):
            for name, module in rows.items():
                t = _once(module, x)
                if round_ >= 2:
                    times[name].append(t)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        active = 3 * args.hidden * args.moe_inter * args.top_k
        print(
            f"1. block fwd+bwd, {args.seq * args.batch} tokens, H={args.hidden}, "
            f"E={args.experts} top-{args.top_k} I={args.moe_inter} "
            f"(active expert params/token {active}; dense I={args.top_k * args.moe_inter}):"
        )
        print(f"   moe {med['moe']:.2f} ms  dense {med['dense']:.2f} ms  "
              f"ratio {med['moe'] / med['dense']:.2f}")  # fmt: skip
    finally:
        pc.destroy()


def a2a_bytes(tokens: int, hidden: int, experts: int, top_k: int) -> dict:
    """On each of 2 ranks: the bytes each all_to_all_single sends in one dispatch + combine."""
    import torch.distributed as dist

    from nanotron_parallel.expert_parallel import make_dispatcher

    dist.init_process_group("gloo")
    sent: list[int] = []
    original = dist.all_to_all_single

    def counting(out, inp, *a, **kw):
        sent.append(inp.numel() * inp.element_size())
        return original(out, inp, *a, **kw)

    dist.all_to_all_single = counting
    try:
        gen = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(tokens, hidden, generator=gen)
        logits = torch.randn(tokens, experts, generator=gen)
        weight, idx = torch.topk(logits.softmax(-1), top_k)
        d = make_dispatcher("alltoall", experts, dist.group.WORLD)
        sent_rows = d.dispatch(x, idx, weight)
        d.combine(sent_rows.tokens, sent_rows.state)
        off_rank = sum(n for r, n in enumerate(sent_rows.state.send) if r != dist.get_rank())
    finally:
        dist.all_to_all_single = original
        dist.destroy_process_group()
    return {"calls": sent, "off_rank_rows": off_rank}


def expert_memory(ep: int, args) -> dict:
    """On every rank of a dp=4 world: the expert bytes held after two ZeRO-1 steps."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.sharding import is_expert_param
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    with shared_default_group():
        cfg = config_from_dict(memory_config(ep, args), "bench", world_size=None)
        pc = ParallelContext(dp=4, ep=ep)
        try:
            trainer = Trainer(cfg, pc, stream=io.StringIO())
            for _ in range(2):
                trainer.train_step()
            experts = [p for _, p in trainer.named_params if is_expert_param(p)]
            params = sum(p.numel() * p.element_size() for p in experts)
            grads = sum(b.grad.untyped_storage().nbytes() for b in trainer.grads.experts.buckets)
            inner = trainer.state.optimizer.inner
            moments = sum(
                t.numel() * t.element_size()
                for pc_ in trainer.state.optimizer.pieces if is_expert_param(pc_.param)
                for k, t in inner.state.get(pc_.master, {}).items() if k != "step"
            )  # fmt: skip
            trainer.close()
        finally:
            dist.barrier()
            pc.destroy()
    return {"params": params, "grads": grads, "moments": moments}


def memory_config(ep: int, args) -> dict:
    return {
        "general": {"seed": 1, "ignore_sanity_checks": True},
        "parallelism": {"dp": 4, "tp": 1, "pp": 1, "expert_parallel_size": ep},
        "model": {
            "model_config": {
                "is_qwen2_config": True, "hidden_size": args.hidden,
                "intermediate_size": 2 * args.hidden, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
                "max_position_embeddings": 64, "tie_word_embeddings": False,
                "_attn_implementation": "sdpa",
                "moe_config": {"num_experts": args.experts, "top_k": args.top_k,
                               "moe_intermediate_size": args.moe_inter},
            },
            "dtype": "float32",
        },
        "tokens": {"sequence_length": 64, "micro_batch_size": 1,
                   "batch_accumulation_per_replica": 1, "train_steps": 2},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-4}, "zero_stage": 1,
                      "accumulate_grad_in_fp32": True, "clip_grad": 1.0,
                      "optimizer_factory": {"torch_adam_is_fused": False}},
        "logging": {"iteration_step_info_interval": 10**6},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-inter", type=int, default=256)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    block_times(args)

    tokens = args.seq * args.batch
    per_rank = run_distributed(a2a_bytes, 2, tokens, args.hidden, args.experts, args.top_k)
    formula = tokens * args.top_k * args.hidden * 4
    print(f"2. all-to-all bytes at ep=2, {tokens} tokens/rank, top-{args.top_k}, H={args.hidden}, "
          f"fp32: formula T*k*H*4 = {formula}")  # fmt: skip
    for rank, got in enumerate(per_rank):
        counts, rows_out, rows_back = got["calls"]
        share = got["off_rank_rows"] / (tokens * args.top_k)
        print(f"   rank {rank}: dispatch {rows_out} ({rows_out / formula:.3f} x formula), "
              f"combine {rows_back} ({rows_back / formula:.3f}), counts {counts}; "
              f"{share:.2f} of the rows leave the rank")  # fmt: skip

    per_expert = 3 * args.hidden * args.moe_inter
    print(
        f"3. expert bytes per rank, dp=4 ZeRO-1, 2 MoE layers x {args.experts} experts x "
        f"3*H*I = {per_expert} params; formula layers*(E/ep)*3HI*(4 + 4 + 8/edp):"
    )
    for ep in (1, 2, 4):
        got = max(run_distributed(expert_memory, 4, ep, args), key=lambda r: sum(r.values()))
        edp = 4 // ep
        want = 2 * (args.experts // ep) * per_expert * (4 + 4 + 8 / edp)
        total = sum(got.values())
        print(
            f"   ep={ep}: params {got['params']}  grads {got['grads']}  moments "
            f"{got['moments']}  total {total}  formula {want:.0f}  ratio {total / want:.3f}"
        )


if __name__ == "__main__":
    main()
