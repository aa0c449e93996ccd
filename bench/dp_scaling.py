"""Data-parallel scaling on the CPU: tokens/s at dp=2 (one thread each) / dp=1 (one thread).

Both runs train the same model with the same per-replica batch (weak scaling: dp=2 processes
twice the tokens per step), measured in this job, alternating, warm-up steps excluded; the
ratio of the medians is printed. Ideal is 2.0 on a machine with 2 free cores.

    .venv/bin/python bench/dp_scaling.py [--steps 8] [--warmup 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import io
import statistics

import torch

from nanotron_parallel.testing import run_distributed


def bench_config(dp: int, steps: int) -> dict:
    return {
        "general": {"seed": 1},
        "parallelism": {"dp": dp},
        "model": {
            "model_config": {
                "hidden_size": 256,
                "intermediate_size": 768,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "vocab_size": 1024,
                "max_position_embeddings": 256,
            },
            "dtype": "float32",
        },
        "tokens": {
            "sequence_length": 128,
            "micro_batch_size": 4,
            "batch_accumulation_per_replica": 2,
            "train_steps": steps,
        },
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-3}, "clip_grad": 1.0},
        "logging": {"iteration_step_info_interval": 1},
    }


def measure(dp: int, steps: int, warmup: int) -> float:
    """Runs on every rank: global tokens/s over the steps after warm-up."""
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import train

    torch.set_num_threads(1)
    records: list[dict] = []
    cfg = config_from_dict(bench_config(dp, steps), "bench")
    train(cfg, stream=io.StringIO(), on_record=records.append)
    timed = records[warmup:]
    tokens = sum(r["tokens_per_sec"] * r["time_per_iteration_ms"] / 1000 for r in timed)
    seconds = sum(r["time_per_iteration_ms"] / 1000 for r in timed)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    one, two = [], []
    for _ in range(args.repeats):
        one.append(run_distributed(measure, 1, 1, args.steps, args.warmup, timeout=600)[0])
        two.append(run_distributed(measure, 2, 2, args.steps, args.warmup, timeout=600)[0])
    t1, t2 = statistics.median(one), statistics.median(two)
    print(f"dp=1 tokens/s: {t1:.1f}  (runs: {', '.join(f'{x:.1f}' for x in one)})")
    print(f"dp=2 tokens/s: {t2:.1f}  (runs: {', '.join(f'{x:.1f}' for x in two)})")
    print(f"dp_scaling ratio (dp=2 / dp=1): {t2 / t1:.3f}")


if __name__ == "__main__":
    main()
