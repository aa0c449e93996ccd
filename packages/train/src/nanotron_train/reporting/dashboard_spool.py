"""The client's spool: the metrics file (JSON lines, one record per logged step) read back to
replay what the dashboard missed, or an in-memory history when the run writes no file.

A record is its step and scalars, plus `moe_load` (per-layer expert counts) when the model has
experts: the dashboard gets those as their own `moe_load` message, replayed with the record.
"""

from __future__ import annotations

import json
import math
from collections import deque
from typing import Any

# A record's per-layer expert loads ({"<layer>": [count per expert]}, moe_metrics.py); not a
# scalar: the metrics file keeps it and the dashboard gets it as a `moe_load` message.
LOAD_KEY = "moe_load"


def loads_of(record: dict[str, Any]) -> dict[str, list[int]] | None:
    """The record's expert loads, or None (no experts, or not the shape the trainer writes)."""
    loads = record.get(LOAD_KEY)
    if not isinstance(loads, dict) or not loads:
        return None
    return loads if all(isinstance(v, list) for v in loads.values()) else None


def moe_load_message(step: int, time_s: float, loads: dict[str, list[int]]) -> dict[str, Any]:
    """The dashboard's `moe_load` message of a record's per-layer expert loads."""
    return {
        "type": "moe_load",
        "step": step,
        "time": time_s,
        "layers": [{"layer": int(k), "counts": v} for k, v in loads.items()],
    }


def spooled(step: int, values: dict[str, Any]) -> dict[str, Any]:
    """What the spool keeps of a logged step: the step, its scalars and its expert loads."""
    rec: dict[str, Any] = {"step": int(step), **numeric_values(values)}
    loads = loads_of(values)
    if loads is not None:
        rec[LOAD_KEY] = loads
    return rec


def numeric_values(record: dict[str, Any]) -> dict[str, float]:
    """The metric values of a metrics-file record: every number except the step itself."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = float(v)
    return out


def jsonable(v: float) -> float | str:
    return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))


def records_after(
    step: int, metrics_file: str | None, start_offset: int, history: deque | None
) -> list[dict[str, Any]]:
    """The records of steps after `step`: this launch's part of the metrics file (from byte
    `start_offset`), or `history` without one."""
    if history is not None:
        return [r for r in history if r["step"] > step]
    out: list[dict[str, Any]] = []
    try:
        with open(metrics_file, "rb") as f:  # type: ignore[arg-type]
            f.seek(start_offset)
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line being written right now
                if (
                    isinstance(rec, dict)
                    and isinstance(rec.get("step"), int)
                    and rec["step"] > step
                ):
                    out.append(spooled(rec["step"], rec))
    except OSError:
        pass
    return out
