"""Muon against AdamW: optimizer step time, and the loss after N steps at a small LR sweep.

1. Optimizer step time (`state.optimizer.step`, gradients of one real step in place), median
   of `--repeats` steps, Muon / AdamW, at dp=1 (this process) and dp=2 ZeRO-1 (two processes,
   one thread each; Muon's two all-reduces and each rank orthogonalising its half of the
   matrices are in the Muon figure). Muon in bfloat16 (torch's) and float32 Newton-Schulz.
2. lm_loss after `--steps` steps on the synthetic token stream (data/synthetic.py: arithmetic
   progressions, learnable), one process: AdamW at each of `--adamw-lrs`, Muon at each of
   `--muon-lrs` (its matrices; the embeddings, lm_head and norms take AdamW at 3e-3), warm-up
   10% then cosine to a tenth. The best of each sweep is compared.

    .venv/bin/python bench/muon.py [--steps 60] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import torch

from nanotron_parallel.testing import run_distributed


def bench_config(dp: int, steps: int, factory: dict, lr: float = 3e-3) -> dict:
    return {
        "general": {"seed": 1},
        "parallelism": {"dp": dp},
        "model": {
            "model_config": {
                "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
                "max_position_embeddings": 128,
            },
            "init_method": {"std": 0.02},
            "dtype": "float32",
        },
        "tokens": {
            "sequence_length": 64, "micro_batch_size": 4,
            "batch_accumulation_per_replica": 2 // dp, "train_steps": steps,
        },
        "optimizer": {
            "zero_stage": 1 if dp > 1 else 0, "weight_decay": 0.01, "clip_grad": 1.0,
            "learning_rate_scheduler": {
                "learning_rate": lr, "lr_warmup_steps": max(1, steps // 10),
                "lr_decay_style": "cosine", "min_decay_lr": lr / 10,
            },
            "optimizer_factory": factory,
        },
        "data_stages": [{"name": "s", "start_training_step": 1, "data": {"dataset": None}}],
        "logging": {"iteration_step_info_interval": 1},
    }  # fmt: skip


FACTORIES = {
    "adamW": {"name": "adamW"},
    "muon-bf16": {"name": "muon", "muon_learning_rate": 0.02},
    "muon-fp32": {"name": "muon", "muon_learning_rate": 0.02, "muon_ns_dtype": "float32"},
}


def step_times(dp: int, repeats: int) -> dict[str, float]:
    """On every rank: median optimizer.step seconds per optimizer (rank 0's figure is used)."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    with shared_default_group():
        for name, factory in FACTORIES.items():
            cfg = config_from_dict(bench_config(dp, 1, factory), "bench", world_size=None)
            pc = ParallelContext(dp=dp)
            try:
                trainer = Trainer(cfg, pc, stream=io.StringIO())
                trainer.train()  # one step: real reduced gradients in place
                opt, times = trainer.state.optimizer, []
                for _ in range(repeats + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    opt.step(1e-4)
                    times.append(time.perf_counter() - t0)
                out[name] = statistics.median(times[1:])
            finally:
                dist.barrier()
                pc.destroy()
    return out


def final_loss(factory: dict, lr: float, steps: int) -> float:
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    cfg = config_from_dict(bench_config(1, steps, factory, lr), "bench", world_size=None)
    pc = ParallelContext()
    try:
        records: list[dict] = []
        Trainer(cfg, pc, stream=io.StringIO()).train(on_record=records.append)
    finally:
        pc.destroy()
    return statistics.mean(r["lm_loss"] for r in records[-5:])  # last 5 steps: less noise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
    ap.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.05])
    args = ap.parse_args()
    torch.set_num_threads(1)
    one = step_times(1, args.repeats)
    two = run_distributed(step_times, 2, 2, args.repeats, timeout=600)[0]
    print("optimizer step, median ms (model: hidden 256, 4 layers, 3.3M params; 1 thread/rank)")
    for label, times in (("dp=1", one), ("dp=2 ZeRO-1", two)):
        row = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items())
        ratios = "  ".join(
            f"{k}/adamW {times[k] / times['adamW']:.2f}" for k in times if k != "adamW"
        )
        print(f"  {label}: {row}  |  {ratios}")
    print(f"lm_loss, mean of the last 5 of {args.steps} steps (synthetic stream, one process)")
    adamw = {lr: final_loss({"name": "adamW"}, lr, args.steps) for lr in args.adamw_lrs}
    muon = {
        lr: final_loss({"name": "muon", "muon_learning_rate": lr}, 3e-3, args.steps)
        for lr in args.muon_lrs
    }
    print("  adamW " + "  ".join(f"lr {lr:g}: {v:.4f}" for lr, v in adamw.items()))
    print("  muon  " + "  ".join(f"lr {lr:g}: {v:.4f}" for lr, v in muon.items()))
    best_a, best_m = min(adamw.items(), key=lambda x: x[1]), min(muon.items(), key=lambda x: x[1])
    print(
        f"  best: adamW {best_a[1]:.4f} (lr {best_a[0]:g}), muon {best_m[1]:.4f} "
        f"(lr {best_m[0]:g}); muon - adamW = {best_m[1] - best_a[1]:+.4f}"
    )


if __name__ == "__main__":
    main()
