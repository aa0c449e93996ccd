"""The planner's predictions next to TorchTitan's published Llama 3.1 8B H100 figures.

TorchTitan's benchmarks/llama3_h100_202412_torchtitan.md (Tables 1 and 3: FSDP, bf16, local
batch 2, sequence 8192, selective activation checkpointing, on 8 and 128 H100s of 96 GB HBM2e
at 500 W). Ours: the same model as a config (ZeRO-3 over dp = FSDP, bf16, mbs 2, m 1), predicted
on the `h100` row (vendor sheet, SXM 80 GB, with the default achievable 0.45) with recompute
off and full (selective checkpointing sits between). Prints a Markdown table with ratios.

    .venv/bin/python bench/plan_published.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.train.test_plan_memory import raw  # noqa: E402

LLAMA31_8B = dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, vocab=128256, seq=8192)
# (table, GPUs, technique, TPS/GPU, memory GiB), bf16 rows only (Float8 is not modelled)
PUBLISHED = [
    ("1", 8, "FSDP", 5762, 82.4),
    ("1", 8, "FSDP + torch.compile", 6667, 77.0),
    ("3", 128, "FSDP", 5605, 67.0),
    ("3", 128, "FSDP + torch.compile", 6514, 62.0),
]


def main() -> None:
    from nanotron_train.config import config_from_dict
    from nanotron_train.plan.devices import DEVICES
    from nanotron_train.plan.enumerate import predict

    print("| table | GPUs | TorchTitan | TPS/GPU | GiB | ours, recompute | TPS/GPU | GiB | "
          "TPS ratio | GiB ratio |\n|---|---:|---|---:|---:|---|---:|---:|---:|---:|")  # fmt: skip
    for table, gpus, technique, tps, gib in PUBLISHED:
        for recompute in (False, True):
            data = raw({**LLAMA31_8B, "dp": gpus, "zero": 3, "mbs": 2, "m": 1,
                        "recompute": recompute})  # fmt: skip
            data["model"]["dtype"] = "bfloat16"
            data["model"]["model_config"]["rope_theta"] = 500000.0
            cfg = config_from_dict(data, "published", world_size=None)
            p = predict(cfg, DEVICES["h100"], gpus, 8)
            ours, mem = p.tokens_per_s_per_device, p.memory.total / 2**30
            print(f"| {table} | {gpus} | {technique} | {tps:,} | {gib} | "
                  f"{'full' if recompute else 'off'} | {ours:,.0f} | {mem:.1f} | "
                  f"{ours / tps:.2f} | {mem / gib:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
