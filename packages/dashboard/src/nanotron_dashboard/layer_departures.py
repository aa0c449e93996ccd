"""The layers that moved first before an alert: one statistic's rows ranked by how early and how
far each departed from its own recent baseline (docs/dashboard.md, "Layers that moved first").

For statistic S and alert step A, over S's detail steps at or before A, in step order:
- the lead: the newest `lead` of them (A itself when it is a detail step);
- the baseline: the `baseline` detail steps before the lead.
Per row, from its finite baseline values: the median m and the spread
s = max(1.4826 * median |v - m|, 1% of |m|, 1e-12) (the median absolute deviation scaled to a
normal distribution's standard deviation: one outlier in the baseline does not widen it; the
floor keeps a flat baseline, a weight norm say, from turning a rounding difference into a
departure). At each lead step the row's departure is |v - m| / s (NaN or infinite v:
infinite). The row departed at the first lead step whose departure is >= `threshold`.
Ranked: the rows that departed, earliest first, then the larger largest departure, then model
order; then the rows that did not, by largest departure; last the rows without a ranking
(fewer than 2 finite baseline values, or no lead value).

Bounded: at most MAX_LEAD + MAX_BASELINE stored steps are read (heatmap.fetch's batches), each
at most 4,096 rows (the ingest's bound); the response lists each row once.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import numpy as np
from sqlalchemy.engine import Connection

from .heatmap import fetch
from .layer_store import layer_stat_names
from .messages import json_float

MAX_LEAD, MAX_BASELINE = 16, 64
MAD_TO_STD = 1.4826  # median absolute deviation -> standard deviation of a normal
REL_FLOOR, ABS_FLOOR = 0.01, 1e-12  # the spread's floor: 1% of |median|
_WHERE = "run_pk=? AND stat=?"


def _steps_around(conn: Connection, pk: int, stat: str, step: int, before: int) -> tuple:
    """The newest `before` detail steps at or before `step` (in order) and the `before`
    detail steps after it (for a heatmap window centred on the alert)."""
    older = conn.exec_driver_sql(
        f"SELECT step FROM layer_stats WHERE {_WHERE} AND step<=? ORDER BY step DESC LIMIT ?",
        (pk, stat, step, before),
    )
    newer = conn.exec_driver_sql(
        f"SELECT step FROM layer_stats WHERE {_WHERE} AND step>? ORDER BY step LIMIT ?",
        (pk, stat, step, before),
    )
    return sorted(int(r[0]) for r in older), [int(r[0]) for r in newer]


def _grid(conn: Connection, pk: int, stat: str, steps: list[int]) -> tuple:
    """(rows in first-seen order, values [steps, rows] float64, present [steps, rows] bool):
    a missing value is absent, a NaN one present."""
    index: dict[str, int] = {}
    read: list[tuple[list[str], list[Any]]] = []
    size = "length(rows) + length(vals)"
    for rows_json, vals_json in fetch(
        conn, "layer_stats", "rows, vals", size, _WHERE, (pk, stat), steps
    ):
        rows = json.loads(rows_json)
        for r in rows:
            index.setdefault(r, len(index))
        read.append((rows, json.loads(vals_json)))
    values = np.full((len(read), len(index)), np.nan)
    present = np.zeros((len(read), len(index)), dtype=bool)
    for j, (rows, vals) in enumerate(read):
        cols = [index[r] for r in rows]
        present[j, cols] = [v is not None for v in vals]
        values[j, cols] = [np.nan if v is None else float(v) for v in vals]
    return list(index), values, present


def _baseline(values: np.ndarray, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the median and spread of its finite baseline values (NaN: fewer than 2)."""
    ok = present & np.isfinite(values)
    kept = np.where(ok, values, np.nan)
    with warnings.catch_warnings():  # an all-NaN column is a row without a baseline
        warnings.simplefilter("ignore", RuntimeWarning)
        median = np.nanmedian(kept, axis=0) if len(kept) else np.full(values.shape[1], np.nan)
        mad = np.nanmedian(np.abs(kept - median), axis=0) if len(kept) else median
    spread = np.maximum(np.maximum(MAD_TO_STD * mad, REL_FLOOR * np.abs(median)), ABS_FLOOR)
    median[ok.sum(axis=0) < 2] = np.nan
    return median, spread


def _json_float(v: float | None) -> float | str | None:
    """A number as the heatmap sends it (NaN and infinities as strings); None stays null here,
    where messages.json_float reads a stored NULL as NaN."""
    return None if v is None else json_float(v)


def _baseline_json(m: float) -> float | None:
    return None if math.isnan(m) else float(m)


def rank(rows: list[str], steps: list[int], values, present, n_lead: int, threshold: float):
    """The ranked rows (module docstring): [{row, first_step, departure, value, median}], with
    `value` the row's value at its first departure (else its newest lead value)."""
    n_base = len(steps) - n_lead
    median, spread = _baseline(values[:n_base], present[:n_base])
    lead, have = values[n_base:], present[n_base:]
    z = np.abs(lead - median) / spread
    z[have & ~np.isfinite(lead)] = np.inf  # a NaN or infinite value departs by itself
    z[~have | np.isnan(median)[None, :]] = np.nan  # no value, or no baseline: no departure
    keyed = []
    for i in range(len(rows)):
        zs = z[:, i]
        scored = np.flatnonzero(~np.isnan(zs))
        if not len(scored):
            keyed.append(((2, 0, 0.0, i), None, None, None))
            continue
        largest = float(zs[scored].max())
        hits = np.flatnonzero(zs >= threshold)
        if len(hits):
            at = int(hits[0])
            keyed.append(((0, at, -largest, i), steps[n_base + at], largest, at))
        else:
            keyed.append(((1, 0, -largest, i), None, largest, int(scored[-1])))
    out = []
    for key, first, largest, at in sorted(keyed, key=lambda k: k[0]):
        i = key[3]
        value = None if at is None else float(lead[at, i])
        out.append({"row": rows[i], "first_step": first, "departure": _json_float(largest),
                    "value": _json_float(value), "median": _baseline_json(median[i])})  # fmt: skip
    return out


def moved_first(
    conn: Connection,
    pk: int,
    stat: str | None,
    step: int,
    lead: int,
    baseline: int,
    threshold: float,
    head: dict[str, Any],
) -> dict[str, Any]:
    """The response of `/api/runs/{id}/layer_stats/moved_first` (docs/dashboard.md)."""
    names = layer_stat_names(conn, pk)
    if stat is None and names:
        stat = "grad_norm" if "grad_norm" in names else names[0]
    out: dict[str, Any] = {**head, "stats": names, "stat": stat, "step": step}
    out |= {"lead": lead, "baseline": baseline, "threshold": threshold}
    before, after = _steps_around(conn, pk, stat or "", step, lead + baseline)
    n_lead = min(lead, len(before))
    out["baseline_steps"], out["lead_steps"] = before[: len(before) - n_lead], before[-n_lead:]
    out["from_step"] = before[0] if before else None  # the window centred on the alert
    out["to_step"] = (after[: len(before)] or before[-1:] or [None])[-1]
    if not before:
        out["lead_steps"], out["ranked"] = [], []
        return out
    rows, values, present = _grid(conn, pk, stat or "", before)
    out["ranked"] = rank(rows, before, values, present, n_lead, threshold)
    return out
