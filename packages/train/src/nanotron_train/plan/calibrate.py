"""Fit the device's achievable FLOP/s from a run's metrics file (`--calibrate METRICS.jsonl`).

The run's records hold model_tflops_per_gpu: the model FLOPs per token x tokens/s per device,
over the whole step (communication and pipeline idle included). The run's own layout (the
config given to the planner, before it varies the layout) predicts the share of its step that
is compute; the fit is the achievable fraction that makes the predicted step time equal the
measured median `time_per_iteration_ms`: achievable = compute FLOPs / peak / (measured step
time - predicted exposed communication - idle - optimizer). Records of the first step
(start-up) are left out. Link bandwidths are not fitted from this file (it holds no per-kind
communication times): they stay the device's; calibrate_dashboard.py fits them from the run's
per-rank telemetry on the dashboard.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from nanotron_train.plan.devices import Device


class CalibrationError(ValueError):
    """A metrics file the planner cannot fit from; the message is one line."""


def step_times_s(path: str) -> list[float]:
    """The measured step times (seconds) of a metrics file, the first step left out."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise CalibrationError(f"--calibrate {path}: cannot read ({exc.strerror})") from None
    times = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise CalibrationError(f"--calibrate {path}: line {n} is not JSON") from None
        ms = rec.get("time_per_iteration_ms") if isinstance(rec, dict) else None
        if isinstance(ms, int | float) and ms > 0 and rec.get("step", 0) > 1:
            times.append(ms / 1000.0)
    if not times:
        raise CalibrationError(
            f"--calibrate {path}: no record with time_per_iteration_ms after step 1"
        )
    return times


def calibrate(device: Device, cfg, path: str) -> Device:
    """The device with `achievable` fitted to the run `cfg` describes (its own layout)."""
    from nanotron_train.plan.enumerate import predict

    measured = statistics.median(step_times_s(path))
    par = cfg.parallelism
    world = par.dp * par.tp * par.pp * par.context_parallel_size
    t = predict(cfg, device, world, world).time
    rest = measured - (t.total - t.compute)
    if rest <= 0:
        raise CalibrationError(
            f"--calibrate {path}: the measured step ({measured:.4g} s) is shorter than the "
            f"predicted communication, idle and optimizer time ({t.total - t.compute:.4g} s)"
        )
    achievable = device.achievable * t.compute / rest
    return dataclasses.replace(
        device, achievable=achievable, source=f"{device.source}; achievable fitted from {path}"
    )
