"""Read side of the telemetry: heatmap data, pipeline timelines, events, samples, labels."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from sqlalchemy.engine import Connection

from .backend import qmarks
from .errors import DashboardError
from .fields import INT64_MAX
from .heatmap import fetch, floats_json, json_body, pick_steps
from .telemetry_messages import (
    LEGACY_RANK_FIELDS,
    MAX_EXTRA_PHASES,
    RANK_FIELDS,
    is_phase_name,
)

# numbers in one heatmap response (ranks x steps x fields): ~25 MB of JSON at most
HEATMAP_NUMBERS = 1_000_000
MAX_FIELDS = len(RANK_FIELDS) + MAX_EXTRA_PHASES  # fields of one request, each once
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


def _names(fields: str | None) -> list[str]:
    """The column names of a row's packed values (NULL: a row of an earlier release)."""
    return json.loads(fields) if fields else list(LEGACY_RANK_FIELDS)


def _ranks_of(conn: Connection, pk: int, step: int) -> tuple[np.ndarray, list[bytes], list[str]]:
    """The ranks of one interval, sorted; each as JSON with its coordinates and host; its
    fields. Encoded rank by rank: 65,536 ranks as dicts would cost ~40 MB."""
    n, cbytes, hosts_json, names = conn.exec_driver_sql(
        "SELECT n, coords, hosts, fields FROM rank_stats WHERE run_pk=? AND step=?", (pk, step)
    ).first()
    coords = np.frombuffer(cbytes, dtype="<i8").reshape(n, 5)
    order = np.argsort(coords[:, 0], kind="stable")
    hosts = json.loads(hosts_json)
    ranks = [
        f'{{"rank":{r},"dp":{dp},"tp":{tp},"pp":{pp},"cp":{cp},"host":{json.dumps(hosts[i])}}}'
        .encode()
        for (r, dp, tp, pp, cp), i in zip(coords[order].tolist(), order.tolist())
    ]  # fmt: skip
    return coords[order, 0].copy(), ranks, _names(names)


def check_fields(fields: list[str]) -> list[str]:
    """The asked fields, each once: known ones or phases, at most MAX_FIELDS."""
    fields = list(dict.fromkeys(fields))
    if len(fields) > MAX_FIELDS:
        raise DashboardError(
            f"{len(fields)} fields asked, over the limit of {MAX_FIELDS} (the known ones and "
            f"{MAX_EXTRA_PHASES} phases)"
        )
    unknown = [f for f in fields if f not in RANK_FIELDS and not is_phase_name(f)]
    if unknown:
        raise DashboardError(
            f"unknown field(s) {', '.join(unknown)[:200]!r}; known: {RANK_FIELDS} or a phase "
            "named like 'name_ms'"
        )
    return fields


def _grid(
    ranks: np.ndarray, fields: list[str], n: int, cbytes: bytes, vbytes: bytes, names: str | None
) -> np.ndarray:
    """One stored interval as a (newest interval's ranks) x fields grid, NaN where missing."""
    have = _names(names)
    row_ranks = np.frombuffer(cbytes, dtype="<i8").reshape(n, 5)[:, 0]
    # a column of NaN at the end stands for the fields this row does not hold
    vals = np.frombuffer(vbytes, dtype="<f8").reshape(n, len(have))
    vals = np.concatenate([vals, np.full((n, 1), np.nan)], axis=1)
    col = [have.index(f) if f in have else len(have) for f in fields]
    pos = np.minimum(np.searchsorted(ranks, row_ranks), len(ranks) - 1)
    keep = ranks[pos] == row_ranks  # a rank the newest interval lacks has no row
    grid = np.full((len(ranks), len(fields)), np.nan)
    grid[pos[keep]] = vals[keep][:, col]
    return grid


def rank_stats(
    conn: Connection,
    pk: int,
    from_step: int | None,
    to_step: int | None,
    max_steps: int,
    fields: list[str],
    head: dict[str, Any],
) -> bytes:
    """Per field, a steps x ranks grid of the intervals in [from_step, to_step], as the
    response's JSON (after `head`'s keys).

    The rows are the ranks of the newest interval (a rank missing from an older one is
    null there). At most `max_steps` intervals, evenly spaced and always the newest, fewer
    when ranks x steps x fields would exceed HEATMAP_NUMBERS (an interval alone over it is
    refused: ask for fewer fields); `total` says how many exist.
    """
    fields = check_fields(fields)
    where = "run_pk=? AND step BETWEEN ? AND ?"
    params = (pk, -1 if from_step is None else from_step, INT64_MAX if to_step is None else to_step)
    total, newest = conn.exec_driver_sql(
        f"SELECT COUNT(*), MAX(step) FROM rank_stats WHERE {where}", params
    ).first()
    out: dict[str, Any] = {**head, "fields": fields, "total": total, "steps": [], "times": []}
    out |= {"intervals": [], "available": list(RANK_FIELDS)}  # and the newest's phases
    if not total:
        return json_body(out, {"ranks": [], "values": {f: [] for f in fields}})
    ranks, rank_json, newest_fields = _ranks_of(conn, pk, newest)
    out["available"] += [f for f in newest_fields if f not in RANK_FIELDS]
    per_interval = len(ranks) * max(len(fields), 1)
    if per_interval > HEATMAP_NUMBERS:
        raise DashboardError(
            f"{len(ranks)} ranks x {len(fields)} fields = {per_interval:,} numbers per interval, "
            f"over the {HEATMAP_NUMBERS:,} numbers a response holds: ask for fewer fields"
        )
    k = max(1, min(max_steps, HEATMAP_NUMBERS // per_interval))
    picked = pick_steps(conn, "rank_stats", where, params, total, k)
    values: dict[str, list[bytes]] = {f: [] for f in fields}
    rows = fetch(
        conn, "rank_stats", "step, time, interval, n, coords, vals, fields",
        "length(coords) + length(vals)", where, params, picked,
    )  # fmt: skip
    for step, t, interval, n, cbytes, vbytes, names in rows:
        grid = _grid(ranks, fields, n, cbytes, vbytes, names)
        out["steps"].append(step)
        out["times"].append(t)
        out["intervals"].append(interval)
        for j, f in enumerate(fields):
            values[f].append(floats_json(grid[:, j]))
    return json_body(out, {"ranks": rank_json, "values": values})


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
