"""The layout planner's prediction for the run's own layout, sent to the dashboard once at start.

The dashboard shows it next to what the run's rank_stats measure (peak memory, step time and
its parts) and flags a part off by more than 20% (nanotron_dashboard/prediction_store.py).
The device is the one `parallelism: auto` plans on (plan/auto.py: the GPU's row of the table
or the `cpu` placeholder), so on a CPU the times are the placeholder's, not a calibration.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

TEXT = 200  # the dashboard's bound on a short text


def prediction_message(cfg, world: int, gpus_per_node: int) -> dict[str, Any]:
    """The `prediction` message of `cfg`'s own layout on this machine's device."""
    from nanotron_train.plan.auto import local_device
    from nanotron_train.plan.enumerate import predict

    device = local_device(gpus_per_node)
    p = predict(cfg, device, world, gpus_per_node)
    t = p.time
    return {
        "type": "prediction",
        "step": 0,
        "time": time.time(),
        "device": device.name[:TEXT],
        "device_source": device.source[:TEXT],
        "memory_bytes": int(p.memory.total),
        "step_ms": 1000 * t.total,
        "compute_ms": 1000 * t.compute,
        "comm_ms": 1000 * t.exposed_comm,
        "idle_ms": 1000 * t.idle,
        "optimizer_ms": 1000 * t.optimizer,
        "tokens_per_s_per_device": p.tokens_per_s_per_device,
        "mfu": p.mfu,
    }


def send_prediction(cfg, pc, logger) -> None:
    """Rank 0, once: the prediction to the dashboard (a no-op without one). A planner that
    cannot predict this config (a model the time model does not cover) costs the run
    nothing but a warning: the prediction is a comparison, not part of training."""
    # without a dashboard client there is no one to compare with: nothing computed
    if pc.rank != 0 or logger is None or not logger.streams_to_dashboard:
        return
    gpus = int(os.environ.get("LOCAL_WORLD_SIZE", pc.world_size))
    try:
        msg = prediction_message(cfg, pc.world_size, gpus)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logging.getLogger(__name__).warning("no layout prediction for the dashboard: %s", exc)
        return
    logger.prediction(msg)
