"""Read side: runs, checkpoints, config diffs and metric series as plain JSON-ready dicts."""

from __future__ import annotations

import functools
import json
import math
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import text
from sqlalchemy.engine import Connection

from . import blocks, telemetry_queries
from .backend import Raw, qmarks, tag_filter
from .checkpoints import newest_complete_step, resume_command
from .errors import DashboardError
from .messages import json_float
from .series import SeriesCache, downsample, ema


class NotFound(DashboardError):
    pass


def status_of(stored: str, heartbeat: float | None, stall_s: float, now: float) -> str:
    if stored == "running" and (heartbeat is None or now - heartbeat > stall_s):
        return "stalled"
    return stored


_RUN_COLS = (
    "pk, id, project, name, status, config, world_size, topology, host, command, cwd, "
    "checkpoints_path, started, updated, heartbeat, finished, error, resumed_from_run, "
    "resumed_from_step, step"
)


def _summary(
    row: Any, last: dict[str, Any], nonfinite: Any, stall_s: float, now: float
) -> dict[str, Any]:
    return {
        "id": row.id,
        "project": row.project,
        "name": row.name,
        "status": status_of(row.status, row.heartbeat, stall_s, now),
        "step": row.step,
        "last": last,
        "host": row.host,
        "world_size": row.world_size,
        "started": row.started,
        "updated": row.updated,
        "finished": row.finished,
        "age_s": None if row.heartbeat is None else max(0.0, now - row.heartbeat),
        "resumed_from": (
            {"run_id": row.resumed_from_run, "step": row.resumed_from_step}
            if row.resumed_from_run
            else None
        ),
        "error": row.error,
        # the first NaN/inf value the run logged: the NaN badge
        "nonfinite": None if nonfinite is None else {"step": nonfinite[0], "metric": nonfinite[1]},
    }


def _cursor(value: str) -> tuple[float, int]:
    """`<started>_<pk>`: a finite float and a pk that SQLite can hold (an int64), else 400."""
    try:
        started, pk = value.split("_", 1)
        c_started, c_pk = float(started), int(pk)
        if not math.isfinite(c_started) or not 0 <= c_pk <= 2**63 - 1:
            raise ValueError
        return c_started, c_pk
    except ValueError:
        raise DashboardError(f"cursor {value[:50]!r} is not one this server gave out") from None


def _run_filters(
    conn: Connection,
    now: float,
    stall_s: float,
    project: str | None,
    status: str | None,
    name: str | None,
    ids: list[str] | None,
    tag: str | None,
) -> tuple[list[str], dict[str, Any]]:
    """The run list's WHERE clauses and their parameters."""
    where: list[str] = []
    params: dict[str, Any] = {}
    if project:
        where.append("project = :project")
        params["project"] = project
    if name:
        where.append("LOWER(name) LIKE LOWER(:name) ESCAPE '\\'")  # case-blind on both backends
        params["name"] = (
            "%" + name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        )
    if tag:
        where.append(tag_filter(conn))
        params["tag"] = tag
    if ids is not None:
        names = [f"id{i}" for i in range(len(ids))]
        where.append(f"id IN ({', '.join(':' + n for n in names)})" if ids else "0 = 1")
        params.update(zip(names, ids))
    if status:  # in SQL, so that pages are full pages: stalled is derived from the heartbeat
        params["stale"] = now - stall_s
        fresh = "(heartbeat IS NOT NULL AND heartbeat >= :stale)"
        where.append(
            {
                "running": f"status = 'running' AND {fresh}",
                "stalled": f"status = 'running' AND NOT {fresh}",
            }.get(status, "status = :status")
        )
        params["status"] = status
    return where, params


def _summaries(conn: Connection, rows: list[Any], stall_s: float, now: float) -> list[dict]:
    """Each run's summary: its latest values, NaN flag, event badges and tags."""
    if not rows:
        return []
    last: dict[int, dict[str, Any]] = {r.pk: {} for r in rows}
    flags: dict[int, Any] = {}
    pks = tuple(last)
    for pk, mname, value in conn.exec_driver_sql(
        "SELECT run_pk, name, value FROM latest WHERE run_pk IN " + qmarks(len(pks)), pks
    ):
        last[pk][mname] = json_float(value)
    for pk, step, mname in conn.exec_driver_sql(
        "SELECT run_pk, step, name FROM run_nonfinite WHERE run_pk IN " + qmarks(len(pks)), pks
    ):
        flags[pk] = (step, mname)
    out = [_summary(r, last[r.pk], flags.get(r.pk), stall_s, now) for r in rows]
    pk_list = [r.pk for r in rows]
    badges = telemetry_queries.event_badges(conn, pk_list)
    labels = telemetry_queries.labels(conn, pk_list)
    for r, summary in zip(rows, out):
        summary["events"] = badges.get(r.pk, {})  # kind -> {count, worst severity}
        summary["tags"] = labels.get(r.pk, ([], ""))[0]
    return out


def list_runs(
    conn: Connection,
    stall_s: float,
    project: str | None = None,
    status: str | None = None,
    name: str | None = None,
    ids: list[str] | None = None,
    limit: int | None = None,
    cursor: str | None = None,
    tag: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first; with `limit`, one page and the cursor of the next one (None at the end)."""
    now = time.time()
    where, params = _run_filters(conn, now, stall_s, project, status, name, ids, tag)
    order = "COALESCE(started, 0)"
    if cursor:
        params["c_started"], params["c_pk"] = _cursor(cursor)
        where.append(f"({order} < :c_started OR ({order} = :c_started AND pk < :c_pk))")
    sql = f"SELECT {_RUN_COLS} FROM runs"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += f" ORDER BY {order} DESC, pk DESC"
    if limit is not None:
        sql += " LIMIT :limit"
        params["limit"] = limit + 1
    rows = conn.execute(text(sql), params).fetchall()
    next_cursor = None
    if limit is not None and len(rows) > limit:
        rows = rows[:limit]
        next_cursor = f"{rows[-1].started or 0.0!r}_{rows[-1].pk}"
    return _summaries(conn, rows, stall_s, now), next_cursor


def run_row(conn: Connection, run_id: str) -> Any:
    if "\x00" in run_id or len(run_id) > 1000:  # no stored id looks like that
        raise NotFound(f"run {run_id[:200]!r} not found")
    row = conn.execute(text(f"SELECT {_RUN_COLS} FROM runs WHERE id = :id"), {"id": run_id}).first()
    if row is None:
        raise NotFound(f"run {run_id!r} not found")
    return row


def get_run(conn: Connection, run_id: str, stall_s: float) -> dict[str, Any]:
    row = run_row(conn, run_id)
    summary = list_runs(conn, stall_s, ids=[run_id])[0][0]
    note = telemetry_queries.labels(conn, [row.pk]).get(row.pk, ([], ""))[1]
    names = [
        r[0]
        for r in conn.execute(
            text("SELECT name FROM latest WHERE run_pk=:pk ORDER BY name"), {"pk": row.pk}
        )
    ]
    children = [
        r[0]
        for r in conn.execute(
            text("SELECT id FROM runs WHERE resumed_from_run=:id"), {"id": run_id}
        )
    ]
    attempts = [
        r[0]
        for r in conn.execute(
            text("SELECT started FROM run_attempts WHERE run_pk=:pk ORDER BY started"),
            {"pk": row.pk},
        )
    ]
    return {
        **summary,
        "attempts": attempts,  # start times of the launches that continued this run
        "config": json.loads(row.config),
        "topology": json.loads(row.topology),
        "command": json.loads(row.command),
        "cwd": row.cwd,
        "checkpoints_path": row.checkpoints_path,
        "metric_names": names,
        "resumed_runs": children,
        "note": note,
    }


def _checkpoint_entry(
    row: Any, command: list[str], newest_of, cid: Any, step: int, path: str, **f: Any
) -> dict:
    """`newest_of(folder)`: the folder's newest complete step, scanned once per listing."""
    resume = resume_command(command, path, newest_of(Path(path).parent)) if command else None
    return {
        "id": cid,
        "step": step,
        "path": path,
        **f,
        "resume_command": resume,
        # what the copy button copies: runnable from any directory
        "resume_shell": f"cd {shlex.quote(row.cwd)} && {resume}" if resume and row.cwd else None,
        "cwd": row.cwd,
    }


def list_checkpoints(
    conn: Connection, run_id: str, on_disk: list[Any] | None = None
) -> list[dict[str, Any]]:
    """The stored checkpoints, plus those found on disk (`on_disk`) that are not stored yet:
    those have `id` None until a POST .../checkpoints/scan stores them (a GET never writes)."""
    row = run_row(conn, run_id)
    command = json.loads(row.command)
    found = {c.step: c for c in on_disk or []}
    newest_of = functools.cache(newest_complete_step)
    out = []
    for c in conn.execute(
        text(
            "SELECT id, step, path, consumed_tokens, topology, size, complete, created, source "
            "FROM checkpoints WHERE run_pk = :pk ORDER BY step"
        ),
        {"pk": row.pk},
    ):
        disk = found.pop(c.step, None)
        out.append(
            _checkpoint_entry(
                row,
                command,
                newest_of,
                c.id,
                c.step,
                c.path,
                consumed_tokens=c.consumed_tokens,
                topology=json.loads(c.topology),
                size=c.size if disk is None else disk.size,
                complete=bool(c.complete) if disk is None else disk.complete,
                created=c.created,
                source=c.source,
            )
        )
    for d in found.values():
        out.append(
            _checkpoint_entry(
                row,
                command,
                newest_of,
                None,
                d.step,
                d.path,
                consumed_tokens=d.consumed_tokens,
                topology=d.topology,
                size=d.size,
                complete=d.complete,
                created=d.created,
                source="disk",
            )
        )
    return sorted(out, key=lambda c: c["step"])


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def config_diff(conn: Connection, a: str, b: str) -> dict[str, Any]:
    ca = _flatten(json.loads(run_row(conn, a).config))
    cb = _flatten(json.loads(run_row(conn, b).config))
    diffs = [
        {
            "key": k,
            "a": ca.get(k),
            "b": cb.get(k),
            "only_in": None if k in ca and k in cb else ("a" if k in ca else "b"),
        }
        for k in sorted(set(ca) | set(cb))
        if ca.get(k, ...) != cb.get(k, ...)
    ]
    return {"a": a, "b": b, "differences": diffs}


def load_series(
    conn: Connection, run_pk: int, name: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One whole series as arrays, from its sealed blocks plus the rows after them, through
    the driver connection (SQLAlchemy rows are slow at 250k rows). NULL becomes NaN."""
    return blocks.load(Raw(conn), run_pk, name)


def metric_series(
    cache: SeriesCache,
    run_pk: int,
    names: list[str],
    x_axis: str,
    max_points: int,
    smoothing: float,
    started: float | None,
) -> dict[str, Any]:
    """Each named series downsampled for drawing; smoothing is computed before downsampling."""
    out: dict[str, Any] = {}
    tokens = None
    if x_axis == "tokens":
        tokens = cache.get(run_pk, "consumed_tokens")
        if len(tokens[0]) == 0:
            raise DashboardError(
                "x=tokens needs the run's consumed_tokens metric, which it has not sent"
            )
    for name in names:
        steps, values, times = cache.get(run_pk, name)
        if x_axis == "step":
            x = steps.astype(np.float64)
        elif x_axis == "time":
            t0 = started if started is not None else (times[0] if len(times) else 0.0)
            x = times - t0
        else:
            assert tokens is not None
            pos = np.searchsorted(tokens[0], steps)
            pos = np.minimum(pos, max(len(tokens[0]) - 1, 0))
            ok = tokens[0][pos] == steps
            x = tokens[1][pos][ok]
            steps, values = steps[ok], values[ok]
        if x_axis != "step":  # refused at ingest; a database from before may still hold them
            finite = np.isfinite(x)
            if not finite.all():
                x, steps, values = x[finite], steps[finite], values[finite]
        smooth = ema(values, smoothing) if smoothing > 0 else None
        idx = downsample(x, values, max_points)
        bad = np.flatnonzero(~np.isfinite(values))
        out[name] = {
            "count": int(len(steps)),
            "x": x[idx].tolist(),
            "step": steps[idx].tolist(),
            "y": [float(v) if np.isfinite(v) else None for v in values[idx]],
            "smooth": None
            if smooth is None
            else [float(v) if np.isfinite(v) else None for v in smooth[idx]],
            # non-finite points are listed (drawn as markers), capped to keep responses small
            "nonfinite": [
                {
                    "x": float(x[i]),
                    "step": int(steps[i]),
                    "value": json_float(None if np.isnan(values[i]) else float(values[i])),
                }
                for i in bad[:1000]
            ],
        }
    return out
