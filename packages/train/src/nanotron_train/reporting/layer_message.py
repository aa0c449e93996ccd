"""Per-layer statistics in a metrics record and as the dashboard's `layer_stats` message.

A detail step's record (reporting/layer_stats.py) holds them under LAYER_KEY as
{statistic: {row name: value}}: rows are parameters (`decoder.3.attn.qkv.weight`) for the
weight norm, gradient norm and update/weight ratio, blocks (`decoder.3`) for the activation
RMS. The metrics file keeps the nested dict; TensorBoard and wandb get one scalar per value
(`layers/<statistic>/<row>`); the dashboard gets a `layer_stats` message (rows listed once,
values aligned with them, null where a statistic has no value for a row). No torch import.
"""

from __future__ import annotations

import math
from typing import Any

LAYER_KEY = "layer_stats"
MAX_ROWS = 4096  # the dashboard's bound on one message's rows (layer_messages.py)


def layer_stats_of(record: dict[str, Any]) -> dict[str, dict[str, float]] | None:
    """The record's per-layer statistics, or None (not a detail step)."""
    stats = record.get(LAYER_KEY)
    if not isinstance(stats, dict) or not stats:
        return None
    return stats if all(isinstance(v, dict) for v in stats.values()) else None


def layer_scalars(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """One scalar per value, for the sinks that take scalars only (TensorBoard, wandb)."""
    return {f"layers/{stat}/{row}": v for stat, rows in stats.items() for row, v in rows.items()}


def layer_stats_message(step: int, time_s: float, stats: dict[str, dict[str, float]]) -> dict:
    """The dashboard's `layer_stats` message: every row once, each statistic's values in the
    rows' order (None where it has none; a non-finite value as the string JSON allows). A
    model with more than MAX_ROWS rows sends its first MAX_ROWS (the metrics file has all)."""
    rows = list(dict.fromkeys(r for values in stats.values() for r in values))[:MAX_ROWS]
    return {
        "type": "layer_stats",
        "step": int(step),
        "time": time_s,
        "rows": rows,
        "stats": {k: [_jsonable(v.get(r)) for r in rows] for k, v in stats.items()},
    }


def _jsonable(v: float | None) -> float | str | None:
    if v is None or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
