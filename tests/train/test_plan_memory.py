"""The memory model (nanotron_train/plan/memory.py: the check before allocation and the
planner's) against the measured peak of each pipeline rank, in 16 small layouts covering dp,
tp (both modes), pp with every engine, cp (all-gather and ring), ep, ZeRO 0-3, recompute on and
off, Llama, Qwen2, a Qwen2 MoE, a Mamba-2 hybrid (Mamba-2, attention and MLP layers) and
Qwen3-Next (Gated DeltaNet, gated attention, MoE): the model's tensor bytes
(`MemoryEstimate.allocated`) are within LOW-HIGH x the measured peak, never under by more
than 5% (docs/planner.md gives the figures).

Measured: the peak of the bytes live in torch's CPU allocator over building the trainer and
training 2 steps (the second holds the optimizer state and the activations at once), each
rank its own (tests/train/allocator_peak.py: exact and the same from run to run, where the
peak RSS this test read before moved by ~10% with the heap's history); ranks of one pp rank
do the same work, so each pp rank's estimate is compared with their median. All layouts share
one world-4 launch; a first tiny run pays the one-time costs before measuring.
"""

from __future__ import annotations

import gc
import io
import statistics

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.allocator_peak import allocator_peak

BASE = dict(hidden=128, inter=384, layers=4, heads=4, kv=2, vocab=1024, seq=256, mbs=4, m=2)
PIPE = dict(m=4, mbs=2)
LAYOUTS = {
    "dp2 tp2": dict(dp=2, tp=2),
    "tp4 sequence parallel, recompute": dict(tp=4, mode="REDUCE_SCATTER", kv=4, recompute=True),
    "pp4 afab": dict(pp=4, engine="afab", **PIPE),
    "pp2 dp2 1f1b": dict(pp=2, dp=2, **PIPE),
    "pp2 tp2 interleaved-1f1b": dict(pp=2, tp=2, engine="interleaved-1f1b", v=2, **PIPE),
    "pp2 dp2 zb-h1": dict(pp=2, dp=2, engine="zb-h1", **PIPE),
    "pp2 dp2 zbv": dict(pp=2, dp=2, engine="zbv", **PIPE),
    "qwen2 cp2 dp2 all-gather": dict(family="qwen2", cp=2, dp=2),
    "cp4 ring": dict(cp=4, cp_attention="ring"),
    "dp4 zero1": dict(dp=4, zero=1, m=1),
    "dp4 zero2 recompute": dict(dp=4, zero=2, m=1, recompute=True),
    "dp4 zero3": dict(dp=4, zero=3, m=1),
    "moe dp4 ep2": dict(family="moe", dp=4, ep=2, m=1),
    "moe dp2 ep2 tp2": dict(family="moe", dp=2, ep=2, tp=2),
    "mamba-2 hybrid cp2 tp2": dict(family="hybrid", cp=2, tp=2),
    "qwen3-next dp2 ep2 tp2 sequence parallel": dict(
        family="qwen3-next", dp=2, ep=2, tp=2, mode="REDUCE_SCATTER"
    ),
}  # fmt: skip
LOW, HIGH = 0.95, 1.15
# Layer kinds M (Mamba-2), * (attention), - (MLP); G* (Gated DeltaNet, gated attention), each
# with a MoE but layer 1's dense MLP
HYBRID = {
    "is_mamba2_config": True,
    "hybrid_override_pattern": "M*-M",
    "num_heads": 8,
    "head_dim": 32,
    "n_groups": 2,
    "state_size": 16,
    "expand": 2,
    "conv_kernel": 4,
    "chunk_size": 32,
}
QWEN3_NEXT = {
    "is_qwen3_next_config": True,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_chunk_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "mlp_only_layers": [1],
}
WARM_UP = dict(layers=1, seq=32, dp=4, m=1)


def raw(layout: dict) -> dict:
    b = {**BASE, **layout}
    mc = {
        "hidden_size": b["hidden"], "intermediate_size": b["inter"],
        "num_hidden_layers": b["layers"], "num_attention_heads": b["heads"],
        "num_key_value_heads": b["kv"], "vocab_size": b["vocab"],
        "max_position_embeddings": b["seq"], "tie_word_embeddings": False,
    }  # fmt: skip
    if b.get("family") in ("qwen2", "moe"):
        mc["is_qwen2_config"] = True
    if b.get("family") == "moe":
        mc["moe_config"] = {
            "num_experts": 4, "top_k": 2, "moe_intermediate_size": b["inter"] // 2,
            "enable_shared_expert": False,
        }  # fmt: skip
    mc.update({"hybrid": HYBRID, "qwen3-next": QWEN3_NEXT}.get(b.get("family"), {}))
    return {
        "general": {"project": "p", "run": "r", "seed": 1},
        "parallelism": {
            "dp": b.get("dp", 1), "tp": b.get("tp", 1), "pp": b.get("pp", 1),
            "pp_engine": b.get("engine", "1f1b"), "tp_mode": b.get("mode", "ALL_REDUCE"),
            "recompute_layer": b.get("recompute", False), "pp_virtual_stages": b.get("v", 1),
            "context_parallel_size": b.get("cp", 1), "expert_parallel_size": b.get("ep", 1),
            "cp_attention": b.get("cp_attention"),
        },
        "model": {"model_config": mc, "dtype": "float32", "init_method": {"std": 0.02}},
        "tokens": {
            "sequence_length": b["seq"], "micro_batch_size": b["mbs"],
            "batch_accumulation_per_replica": b["m"], "train_steps": 2,
        },
        "optimizer": {
            "zero_stage": b.get("zero", 0), "weight_decay": 0.1, "clip_grad": 1.0,
            "learning_rate_scheduler": {"learning_rate": 1e-3, "lr_warmup_steps": 1},
        },
        "checkpoints": {"checkpoints_path": None},
        "data_stages": [{"name": "s", "start_training_step": 1, "data": {"dataset": None, "seed": 3}}],
        "logging": {"iteration_step_info_interval": 1, "metrics_file": None},
    }  # fmt: skip


def measure(layouts: list[dict]) -> list[dict]:
    """On every rank: each layout's (pp rank, measured allocator peak, estimate per pp rank)."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.plan.memory import estimate_ranks
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for layout in [WARM_UP, *layouts]:
            cfg = config_from_dict(raw(layout), "plan-memory", world_size=None)
            p = cfg.parallelism
            gc.collect()  # the previous layout's cycles freed now, not during this one
            pc = ParallelContext(
                dp=p.dp, tp=p.tp, pp=p.pp, cp=p.context_parallel_size, ep=p.expert_parallel_size
            )
            try:
                with allocator_peak() as peak:
                    Trainer(cfg, pc, stream=io.StringIO()).train()
            finally:
                dist.barrier()
                pc.destroy()
            out.append(
                {"pp_rank": pc.pp_rank, "measured": peak["bytes"],
                 "estimates": [e.allocated for e in estimate_ranks(cfg)]}
            )  # fmt: skip
    return out[1:]


@pytest.fixture(scope="module")
def ratios() -> dict[str, list[float]]:
    per_rank = run_distributed(measure, 4, list(LAYOUTS.values()), timeout=600)
    out = {}
    for i, name in enumerate(LAYOUTS):
        rows = [ranks[i] for ranks in per_rank]
        estimates = rows[0]["estimates"]
        out[name] = [
            estimates[stage]
            / statistics.median(r["measured"] for r in rows if r["pp_rank"] == stage)
            for stage in range(len(estimates))
        ]
        print(f"{name}: estimate / measured per pp rank {[round(r, 3) for r in out[name]]}")
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_estimate_within_the_stated_band(ratios, name):
    got = ratios[name]
    assert all(LOW <= r <= HIGH for r in got), (name, got)
