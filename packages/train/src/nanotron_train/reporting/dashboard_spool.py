"""The client's spool: the metrics file (JSON lines, one record per logged step) read back to
replay what the dashboard missed, or an in-memory history when the run writes no file."""

from __future__ import annotations

import json
import math
from collections import deque
from typing import Any


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
                    out.append({"step": rec["step"], **numeric_values(rec)})
    except OSError:
        pass
    return out
