"""Read side of the telemetry: heatmap data, pipeline timelines, events, samples, labels."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from sqlalchemy.engine import Connection

from .backend import qmarks
from .errors import DashboardError
from .telemetry_messages import LEGACY_RANK_FIELDS, PHASE_NAME, RANK_FIELDS

# numbers in one heatmap response (ranks x steps x fields): ~10 MB of JSON at most
HEATMAP_NUMBERS = 1_000_000
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


def _floats(a: np.ndarray) -> list[float | None]:
    return [None if v != v else float(v) for v in a.tolist()]  # NaN (a null) -> None


def _names(fields: str | None) -> list[str]:
    """The column names of a row's packed values (NULL: a row of an earlier release)."""
    return json.loads(fields) if fields else list(LEGACY_RANK_FIELDS)


def _ranks_of(conn: Connection, pk: int, step: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The ranks of one interval, by rank, with their coordinates and hosts; its fields."""
    newest = conn.exec_driver_sql(
        "SELECT n, coords, hosts, fields FROM rank_stats WHERE run_pk=? AND step=?", (pk, step)
    ).first()
    coords = np.frombuffer(newest[1], dtype="<i8").reshape(newest[0], 5)
    order = np.argsort(coords[:, 0], kind="stable")
    hosts = json.loads(newest[2])
    return [
        {"rank": int(c[0]), "dp": int(c[1]), "tp": int(c[2]), "pp": int(c[3]), "cp": int(c[4]),
         "host": hosts[i]}
        for c, i in zip(coords[order], order.tolist())
    ], _names(newest[3])  # fmt: skip


def rank_stats(
    conn: Connection,
    pk: int,
    from_step: int | None,
    to_step: int | None,
    max_steps: int,
    fields: list[str],
) -> dict[str, Any]:
    """Per field, a steps x ranks grid of the intervals in [from_step, to_step].

    The rows are the ranks of the newest interval (a rank missing from an older one is
    None there). At most `max_steps` intervals, evenly spaced and always the newest, fewer
    when ranks x steps x fields would exceed HEATMAP_NUMBERS; `total` says how many exist.
    """
    unknown = [f for f in fields if f not in RANK_FIELDS and not re.match(PHASE_NAME, f)]
    if unknown:
        raise DashboardError(
            f"unknown field(s) {', '.join(unknown)[:200]}; known: {RANK_FIELDS} or a phase "
            "named like 'name_ms'"
        )
    lo = -1 if from_step is None else from_step
    hi = 2**63 - 1 if to_step is None else to_step
    steps = [
        r[0]
        for r in conn.exec_driver_sql(
            "SELECT step FROM rank_stats WHERE run_pk=? AND step BETWEEN ? AND ? ORDER BY step",
            (pk, lo, hi),
        )
    ]
    out: dict[str, Any] = {"fields": fields, "total": len(steps), "steps": [], "times": []}
    out |= {"intervals": [], "ranks": [], "values": {f: [] for f in fields}}
    out["available"] = list(RANK_FIELDS)  # and the phases the newest interval has
    if not steps:
        return out
    out["ranks"], newest = _ranks_of(conn, pk, steps[-1])
    out["available"] += [f for f in newest if f not in RANK_FIELDS]
    row_of = {r["rank"]: i for i, r in enumerate(out["ranks"])}
    budget = max(1, HEATMAP_NUMBERS // (len(row_of) * max(len(fields), 1)))
    k = max(1, min(max_steps, budget, len(steps)))
    picked = sorted({steps[int(round(i))] for i in np.linspace(0, len(steps) - 1, k)})
    for step, t, interval, n, cbytes, vbytes, names in conn.exec_driver_sql(
        "SELECT step, time, interval, n, coords, vals, fields FROM rank_stats WHERE run_pk=? "
        f"AND step IN {qmarks(len(picked))} ORDER BY step",
        (pk, *picked),
    ):
        have = _names(names)
        ranks = np.frombuffer(cbytes, dtype="<i8").reshape(n, 5)[:, 0]
        # a column of NaN at the end stands for the fields this row does not hold
        vals = np.frombuffer(vbytes, dtype="<f8").reshape(n, len(have))
        vals = np.concatenate([vals, np.full((n, 1), np.nan)], axis=1)
        col = [have.index(f) if f in have else len(have) for f in fields]
        grid = np.full((len(row_of), len(fields)), np.nan)
        rows = np.array([row_of.get(int(r), -1) for r in ranks])
        keep = rows >= 0
        grid[rows[keep]] = vals[keep][:, col]
        out["steps"].append(step)
        out["times"].append(t)
        out["intervals"].append(interval)
        for j, f in enumerate(fields):
            out["values"][f].append(_floats(grid[:, j]))
    return out


def timelines(conn: Connection, pk: int, limit: int) -> list[dict[str, Any]]:
    """The newest `limit` recorded steps (oldest first), without their spans."""
    rows = conn.exec_driver_sql(
        "SELECT step, time, schedule, pp, chunks, micro_batches, bubble_measured, "
        "bubble_formula, n_spans FROM timelines WHERE run_pk=? ORDER BY step DESC LIMIT ?",
        (pk, limit),
    ).fetchall()
    keys = ("step", "time", "schedule", "pp", "chunks", "micro_batches", "bubble_measured")
    return [dict(zip((*keys, "bubble_formula", "spans"), r)) for r in reversed(rows)]


def timeline(conn: Connection, pk: int, step: int) -> dict[str, Any] | None:
    row = conn.exec_driver_sql(
        "SELECT step, time, schedule, pp, chunks, micro_batches, bubble_measured, "
        "bubble_formula, spans, clock FROM timelines WHERE run_pk=? AND step=?",
        (pk, step),
    ).first()
    if row is None:
        return None
    keys = ("step", "time", "schedule", "pp", "chunks", "micro_batches", "bubble_measured")
    out = dict(zip((*keys, "bubble_formula"), row[:8]))
    out["spans"] = [
        {"stage": s, "chunk": c, "micro_batch": mb, "kind": _span_kind(k),
         "start_ms": a, "end_ms": b}
        for s, c, mb, k, a, b in json.loads(row[8])
    ]  # fmt: skip
    out["clock"] = json.loads(row[9])
    return out


def _span_kind(k: str | int) -> str:
    """Spans carry their kind's name. Timelines stored by releases that had only two kinds
    hold a code instead (0 forward, 1 backward): the file format they were written in."""
    return k if isinstance(k, str) else ("forward", "backward")[k]


def events(conn: Connection, pk: int, run_id: str, kind: str | None, limit: int) -> list[dict]:
    """The newest `limit` events (of one kind, if given), oldest first."""
    sql = "SELECT id, step, time, kind, severity, message, details, source FROM events "
    sql += "WHERE run_pk=?" + (" AND kind=?" if kind else "") + " ORDER BY id DESC LIMIT ?"
    params = (pk, kind, limit) if kind else (pk, limit)
    rows = conn.exec_driver_sql(sql, params).fetchall()
    return [
        {"id": i, "run_id": run_id, "step": st, "time": t, "kind": k, "severity": sev,
         "message": m, "details": json.loads(d), "source": src}
        for i, st, t, k, sev, m, d, src in reversed(rows)
    ]  # fmt: skip


def samples(conn: Connection, pk: int, limit: int) -> list[dict[str, Any]]:
    """The newest `limit` checkpoints' samples, oldest first."""
    rows = conn.exec_driver_sql(
        "SELECT step, time, max_new_tokens, samples FROM samples WHERE run_pk=? "
        "ORDER BY step DESC LIMIT ?",
        (pk, limit),
    ).fetchall()
    return [
        {"step": s, "time": t, "max_new_tokens": m, "samples": json.loads(x)}
        for s, t, m, x in reversed(rows)
    ]


def event_badges(conn: Connection, pks: list[int]) -> dict[int, dict[str, dict[str, Any]]]:
    """Per run, per event kind: the count and the worst severity (the run list's badges)."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for pk, kind, n, worst in conn.exec_driver_sql(
        "SELECT run_pk, kind, COUNT(*), MAX(CASE severity WHEN 'critical' THEN 2 "
        "WHEN 'warning' THEN 1 ELSE 0 END) FROM events WHERE run_pk IN "
        f"{qmarks(len(pks))} GROUP BY run_pk, kind",
        tuple(pks),
    ):
        severity = next(k for k, v in SEVERITY_RANK.items() if v == worst)
        out.setdefault(pk, {})[kind] = {"count": n, "severity": severity}
    return out


def labels(conn: Connection, pks: list[int]) -> dict[int, tuple[list[str], str]]:
    return {
        pk: (json.loads(tags), note)
        for pk, tags, note in conn.exec_driver_sql(
            "SELECT run_pk, tags, note FROM run_labels WHERE run_pk IN " + qmarks(len(pks)),
            tuple(pks),
        )
    }
