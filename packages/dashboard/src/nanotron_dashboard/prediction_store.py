"""The planner's prediction of a run (`prediction` messages) and the run's measurement of the
same quantities, side by side (GET /api/runs/{id}/prediction).

Measured, from the run's stored rank_stats intervals (the first left out as start-up when
there are others; the newest MEASURED_INTERVALS at most): each phase's mean over the ranks of
an interval, then the median over the intervals; peak memory is the largest mem_bytes of any
rank and interval. The phases map onto the planner's parts: compute = compute_ms,
communication = tp_comm_ms + all_to_all_ms + dp_wait_ms (the waits the planner calls exposed),
pipeline idle = pp_wait_ms, optimizer = optimizer_ms, step = step_ms. A part is flagged when
the prediction is off by more than OFF (|predicted - measured| / measured), unless both are
below NEGLIGIBLE of the measured step (then there is no ratio to speak of).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from sqlalchemy.engine import Connection

from .prediction_messages import Prediction
from .telemetry_messages import LEGACY_RANK_FIELDS

OFF = 0.20
NEGLIGIBLE = 0.01
MEASURED_INTERVALS = 50
# part -> the rank_stats fields whose per-interval means add up to it
PARTS: dict[str, tuple[str, ...]] = {
    "step_ms": ("step_ms",),
    "compute_ms": ("compute_ms",),
    "comm_ms": ("tp_comm_ms", "all_to_all_ms", "dp_wait_ms"),
    "idle_ms": ("pp_wait_ms",),
    "optimizer_ms": ("optimizer_ms",),
}


def store_prediction(conn: Connection, pk: int, m: Prediction) -> bool:
    body = m.model_dump(exclude={"type", "run_id", "ack"})
    conn.exec_driver_sql(
        "INSERT INTO predictions(run_pk, time, body) VALUES (?, ?, ?) ON CONFLICT(run_pk) DO "
        "UPDATE SET time=excluded.time, body=excluded.body",
        (pk, m.time, json.dumps(body, allow_nan=False)),
    )
    return True


def _intervals(conn: Connection, pk: int) -> list[dict[str, np.ndarray]]:
    """The newest intervals' columns by field name, the run's first one left out."""
    rows = conn.exec_driver_sql(
        "SELECT n, vals, fields FROM rank_stats WHERE run_pk=? ORDER BY step DESC LIMIT ?",
        (pk, MEASURED_INTERVALS + 1),
    ).fetchall()
    # the oldest read: the run's first (start-up) when it read fewer than the limit, else one
    # past the newest MEASURED_INTERVALS; a run's only interval is kept
    out = []
    for n, vals, fields in rows[:-1] if len(rows) > 1 else rows:
        names = json.loads(fields) if fields else list(LEGACY_RANK_FIELDS)
        table = np.frombuffer(vals, dtype="<f8").reshape(n, len(names))
        out.append({name: table[:, i] for i, name in enumerate(names)})
    return out


def _finite(value: float) -> float | None:
    """Finite stored numbers can still add up, or divide, past the largest float: no number."""
    return value if math.isfinite(value) else None


def _mean(col: np.ndarray | None) -> float:
    if col is None or np.isnan(col).all():
        return math.nan
    with np.errstate(over="ignore"):  # an overflowing sum is inf, dropped by _finite
        return float(np.nanmean(col))


def measured(conn: Connection, pk: int) -> dict[str, Any] | None:
    intervals = _intervals(conn, pk)
    if not intervals:
        return None
    out: dict[str, Any] = {"intervals": len(intervals)}
    for part, fields in PARTS.items():
        per = []
        for iv in intervals:
            means = [_mean(iv.get(f)) for f in fields]
            known = [v for v in means if not math.isnan(v)]
            per.append(sum(known) if known else math.nan)
        per = [v for v in per if not math.isnan(v)]
        out[part] = _finite(float(np.median(per))) if per else None
    mem = [np.nanmax(iv["mem_bytes"]) for iv in intervals if "mem_bytes" in iv]
    mem = [v for v in mem if not math.isnan(v)]
    out["memory_bytes"] = int(max(mem)) if mem else None
    return out


def compare(pred: dict[str, Any], meas: dict[str, Any] | None) -> dict[str, Any]:
    """Per part: predicted / measured and whether it is off by more than OFF."""
    if meas is None:
        return {}
    step = meas.get("step_ms") or 0.0
    rows = {}
    for part in ("memory_bytes", *PARTS):
        p, m = pred.get(part), meas.get(part)
        if p is None or m is None:
            rows[part] = {"ratio": None, "off": False}
        elif part != "memory_bytes" and max(p, m) < NEGLIGIBLE * step:
            rows[part] = {"ratio": None, "off": False, "negligible": True}
        elif m <= 0:
            rows[part] = {"ratio": None, "off": p > 0}
        else:
            rows[part] = {"ratio": _finite(p / m), "off": abs(p - m) / m > OFF}
    return rows


def prediction(conn: Connection, pk: int) -> dict[str, Any]:
    row = conn.exec_driver_sql("SELECT body FROM predictions WHERE run_pk=?", (pk,)).first()
    pred = json.loads(row[0]) if row else None
    meas = measured(conn, pk) if pred else None
    return {
        "predicted": pred,
        "measured": meas,
        "compare": compare(pred, meas) if pred else {},
        "off_threshold": OFF,
    }
