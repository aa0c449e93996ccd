"""Read side: runs, checkpoints, config diffs and metric series as plain JSON-ready dicts."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from sqlalchemy import text
from sqlalchemy.engine import Connection

from . import blocks
from .checkpoints import resume_command
from .errors import DashboardError
from .messages import json_float
from .series import SeriesCache, downsample, ema

STATUSES = ("running", "finished", "failed", "stalled")


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


def _summary(row: Any, last: dict[str, Any], stall_s: float, now: float) -> dict[str, Any]:
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
    }


def list_runs(
    conn: Connection,
    stall_s: float,
    project: str | None = None,
    status: str | None = None,
    name: str | None = None,
    ids: list[str] | None = None,
) -> list[dict[str, Any]]:
    where, params = [], {}
    if project:
        where.append("project = :project")
        params["project"] = project
    if name:
        where.append("name LIKE :name ESCAPE '\\'")
        params["name"] = (
            "%" + name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        )
    if ids is not None:
        where.append("id IN (SELECT value FROM json_each(:ids))")
        params["ids"] = json.dumps(ids)
    sql = f"SELECT {_RUN_COLS} FROM runs"
    if where:
        sql += " WHERE " + " AND ".join(where)
    rows = conn.execute(text(sql + " ORDER BY started DESC, pk DESC"), params).fetchall()
    last: dict[int, dict[str, Any]] = {r.pk: {} for r in rows}
    if rows:
        for pk, mname, value in conn.execute(
            text(
                "SELECT run_pk, name, value FROM latest WHERE run_pk IN "
                "(SELECT value FROM json_each(:pks))"
            ),
            {"pks": json.dumps(list(last))},
        ):
            last[pk][mname] = json_float(value)
    now = time.time()
    out = [_summary(r, last[r.pk], stall_s, now) for r in rows]
    if status:
        out = [r for r in out if r["status"] == status]
    return out


def run_row(conn: Connection, run_id: str) -> Any:
    row = conn.execute(text(f"SELECT {_RUN_COLS} FROM runs WHERE id = :id"), {"id": run_id}).first()
    if row is None:
        raise NotFound(f"run {run_id!r} not found")
    return row


def get_run(conn: Connection, run_id: str, stall_s: float) -> dict[str, Any]:
    row = run_row(conn, run_id)
    summary = list_runs(conn, stall_s, ids=[run_id])[0]
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
    return {
        **summary,
        "config": json.loads(row.config),
        "topology": json.loads(row.topology),
        "command": json.loads(row.command),
        "cwd": row.cwd,
        "checkpoints_path": row.checkpoints_path,
        "metric_names": names,
        "resumed_runs": children,
    }


def list_checkpoints(conn: Connection, run_id: str) -> list[dict[str, Any]]:
    row = run_row(conn, run_id)
    command = json.loads(row.command)
    out = []
    for c in conn.execute(
        text(
            "SELECT id, step, path, consumed_tokens, topology, size, complete, created, source "
            "FROM checkpoints WHERE run_pk = :pk ORDER BY step"
        ),
        {"pk": row.pk},
    ):
        out.append(
            {
                "id": c.id,
                "step": c.step,
                "path": c.path,
                "consumed_tokens": c.consumed_tokens,
                "topology": json.loads(c.topology),
                "size": c.size,
                "complete": bool(c.complete),
                "created": c.created,
                "source": c.source,
                "resume_command": resume_command(command, c.path) if command else None,
                # what the copy button copies: runnable from any directory
                "resume_shell": (
                    f"cd {shlex.quote(row.cwd)} && {resume_command(command, c.path)}"
                    if command and row.cwd
                    else None
                ),
                "cwd": row.cwd,
            }
        )
    return out


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
    the raw sqlite3 connection (SQLAlchemy rows are slow at 250k rows). NULL becomes NaN."""
    return blocks.load(conn.connection.driver_connection, run_pk, name)


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


def csv_rows(conn: Connection, run_id: str, names: list[str] | None) -> Iterator[str]:
    """Full-fidelity wide CSV: one row per step, one column per metric; repr() of floats."""
    row = run_row(conn, run_id)
    all_names = [
        r[0]
        for r in conn.execute(
            text("SELECT name FROM latest WHERE run_pk=:pk ORDER BY name"), {"pk": row.pk}
        )
    ]
    cols = [n for n in all_names if not names or n in names]
    yield ",".join(["step", *cols]) + "\n"
    col_of = {n: i for i, n in enumerate(cols)}
    cur_step, cur = None, [""] * len(cols)
    res = conn.exec_driver_sql(
        "SELECT step, name, value FROM metrics WHERE run_pk=? ORDER BY step", (row.pk,)
    )
    for step, name, value in res:
        if name not in col_of:
            continue
        if step != cur_step:
            if cur_step is not None:
                yield f"{cur_step}," + ",".join(cur) + "\n"
            cur_step, cur = step, [""] * len(cols)
        cur[col_of[name]] = "nan" if value is None else repr(float(value))
    if cur_step is not None:
        yield f"{cur_step}," + ",".join(cur) + "\n"
