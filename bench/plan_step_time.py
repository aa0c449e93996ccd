"""The planner's step time against measured, on this machine, after one calibration.

A small Llama (hidden 256, 4 layers, vocabulary 2048, sequence 256, global batch 8 sequences,
fp32) trains STEPS steps in each layout; the measured step time is the median of steps 2 on.
The planner's `cpu` device is calibrated (`plan/calibrate.py`, the path of `--calibrate`) on
the one-process run's metrics, then predicts the other layouts (1-4 processes, gloo). Printed:
each layout's predicted and measured step time and their ratio, the Spearman rank correlation
and the worst ratio. Link bandwidths are the `cpu` row's placeholders (not fitted).

    .venv/bin/python bench/plan_step_time.py [--steps 5]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.train.test_plan_memory import raw  # noqa: E402

SIZES = dict(hidden=256, inter=768, layers=4, heads=8, kv=4, vocab=2048, seq=256)
REFERENCE = dict(mbs=4, m=2)
LAYOUTS = {
    1: {"mbs1 m8": dict(mbs=1, m=8), "recompute": dict(mbs=4, m=2, recompute=True)},
    2: {
        "dp2": dict(dp=2, mbs=2, m=2), "tp2": dict(tp=2, mbs=4, m=2),
        "pp2 1f1b": dict(pp=2, mbs=2, m=4), "cp2": dict(cp=2, mbs=4, m=2),
    },
    4: {"dp4": dict(dp=4, mbs=2, m=1), "dp2 pp2 afab": dict(dp=2, pp=2, engine="afab", mbs=1, m=4)},
}  # fmt: skip


def measure(layouts: list[dict], steps: int) -> list[float]:
    """On every rank: each layout's median step time (s), steps 2 on."""
    import torch
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for layout in layouts:
            data = raw({**SIZES, **layout})
            data["tokens"]["train_steps"] = steps
            cfg = config_from_dict(data, "bench", world_size=None)
            p = cfg.parallelism
            pc = ParallelContext(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.context_parallel_size)
            times: list[float] = []
            try:
                Trainer(cfg, pc, stream=io.StringIO()).train(
                    on_record=lambda r, times=times: times.append(r["time_per_iteration_ms"] / 1000)
                    if r["step"] > 1 else None, every_step=True,
                )  # fmt: skip
            finally:
                dist.barrier()
                pc.destroy()
            out.append(statistics.median(times))
    return out


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0] * len(x)
        for i, j in enumerate(order):
            r[j] = i
        return r

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from nanotron_parallel.testing import run_distributed
    from nanotron_train.config import config_from_dict
    from nanotron_train.plan.calibrate import calibrate
    from nanotron_train.plan.devices import DEVICES
    from nanotron_train.plan.enumerate import predict

    measured = {"reference": measure([REFERENCE], args.steps)[0]}
    for world, named in LAYOUTS.items():
        lays = list(named.values())
        got = measure(lays, args.steps) if world == 1 else run_distributed(
            measure, world, lays, args.steps, timeout=1200)[0]  # fmt: skip
        measured.update(zip(named, got))
    ref_cfg = config_from_dict(raw({**SIZES, **REFERENCE}), "bench", world_size=None)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(json.dumps({"step": 2, "time_per_iteration_ms": measured["reference"] * 1000}))
    device = calibrate(DEVICES["cpu"], ref_cfg, f.name)
    print(
        f"calibrated achievable: {device.achievable * DEVICES['cpu'].peak_flops / 1e9:.2f} GFLOP/s"
    )
    print("| layout | predicted s | measured s | predicted / measured |\n|---|---:|---:|---:|")
    pred, meas = [], []
    for world, named in LAYOUTS.items():
        for name, lay in named.items():
            cfg = config_from_dict(raw({**SIZES, **lay}), "bench", world_size=None)
            t = predict(cfg, device, world, world).time.total
            pred.append(t)
            meas.append(measured[name])
            print(f"| {name} | {t:.3f} | {measured[name]:.3f} | {t / measured[name]:.2f} |")
    worst = max(max(p / m, m / p) for p, m in zip(pred, meas))
    print(f"Spearman rank correlation {spearman(pred, meas):.2f}; worst ratio {worst:.2f}")


if __name__ == "__main__":
    main()
