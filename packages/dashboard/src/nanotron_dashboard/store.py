"""The SQL each run, metrics and checkpoint message becomes (run in the writer's transaction),
and the result helpers. The telemetry messages' SQL is in telemetry_store.py."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from .backend import (
    is_disk_full,  # noqa: F401  (the writer imports it from here)
    is_pg,
)
from .checkpoints import infer_resumed_from
from .messages import RunStart
from .paths import key_of

log = logging.getLogger("nanotron_dashboard")

INSERT_METRIC = (
    "INSERT INTO metrics(run_pk, name, step, value, time) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT(run_pk, name, step) DO UPDATE SET value=excluded.value, time=excluded.time"
)
UPSERT_LATEST = (
    "INSERT INTO latest(run_pk, name, step, value) VALUES (?, ?, ?, ?) "
    "ON CONFLICT(run_pk, name) DO UPDATE SET step=excluded.step, value=excluded.value "
    "WHERE excluded.step >= latest.step"
)
NONFINITE = (
    "INSERT INTO run_nonfinite(run_pk, step, name) VALUES (?, ?, ?) "
    "ON CONFLICT(run_pk) DO UPDATE SET step=excluded.step, name=excluded.name "
    "WHERE excluded.step < run_nonfinite.step"
)
# PostgreSQL: a batch's points as five arrays in one statement (one round trip, not one per
# point as executemany would make)
INSERT_METRIC_ARRAYS = (
    "INSERT INTO metrics(run_pk, name, step, value, time) SELECT * FROM unnest("
    "?::integer[], ?::text[], ?::bigint[], ?::double precision[], ?::double precision[]) "
    "ON CONFLICT(run_pk, name, step) DO UPDATE SET value=excluded.value, time=excluded.time"
)
DISK_FULL_LOG_EVERY_S = 60.0


def refusal(status: int, error: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "status": status, "error": error, **extra}


UPSERT_RUN = (
    "INSERT INTO runs(id, project, name, status, config, world_size, topology, host, "
    "command, cwd, checkpoints_path, checkpoints_key, started, updated, heartbeat, "
    "resumed_from_run, resumed_from_step) VALUES (:id, :project, :name, 'running', :config, "
    ":ws, :topology, :host, :command, :cwd, :cp, :cpkey, :started, :now, :now, :rfr, :rfs) "
    "ON CONFLICT(id) DO UPDATE SET project=excluded.project, name=excluded.name, "
    "status='running', config=excluded.config, world_size=excluded.world_size, "
    "topology=excluded.topology, host=excluded.host, command=excluded.command, "
    "cwd=excluded.cwd, checkpoints_path=excluded.checkpoints_path, "
    "checkpoints_key=excluded.checkpoints_key, "
    "updated=:now, heartbeat=:now, finished=NULL, error=NULL, "
    "started=COALESCE(runs.started, excluded.started), "
    "resumed_from_run=COALESCE(excluded.resumed_from_run, runs.resumed_from_run), "
    "resumed_from_step=COALESCE(excluded.resumed_from_step, runs.resumed_from_step)"
)


def _command_changed(conn: Connection, m: RunStart) -> dict[str, Any] | None:
    """The command, cwd and checkpoints path are what Resume runs: fixed by the first
    run_start. The same one again (a replay after a restart) is fine; another is a 409."""
    prev = conn.execute(
        text("SELECT command, cwd, checkpoints_path FROM runs WHERE id=:id"), {"id": m.run_id}
    ).first()
    new = (json.dumps(m.command), m.cwd, m.checkpoints_path)
    if prev is None or (prev[0] == "[]" and not prev[1] and not prev[2]) or tuple(prev) == new:
        return None
    log.warning(
        "dashboard: refused a run_start for run %r that would change its command, cwd "
        "or checkpoints path (kept: %s in %r)",
        m.run_id,
        prev[0][:200],
        prev[1],
    )
    return refusal(
        409,
        f"run {m.run_id!r} already exists with another command, cwd or checkpoints "
        "path; they are fixed by its first run_start (start a new run id instead)",
        type="run_start",
        run_id=m.run_id,
    )


def upsert_run(conn: Connection, m: RunStart, now: float) -> dict[str, Any] | None:
    """Create or refresh a run from its run_start; a refusal (409) when it would change the
    run's command, cwd or checkpoints path."""
    refused = _command_changed(conn, m)
    if refused is not None:
        return refused
    rf = m.resumed_from
    rf_run, rf_step = (rf.run_id, rf.step) if rf else (None, None)
    if rf_run is None:
        rf_run, rf_step = infer_resumed_from(conn, m.command, m.cwd, m.run_id)
    params = {
        "id": m.run_id,
        "project": m.project,
        "name": m.name or m.run_id,
        "config": json.dumps(m.config, default=str),
        "ws": m.world_size,
        "topology": json.dumps(m.topology, default=str),
        "host": m.host,
        "command": json.dumps(m.command),
        "cwd": m.cwd,
        "cp": m.checkpoints_path,
        "cpkey": key_of(m.checkpoints_path, m.cwd),  # resolved once, here
        "started": m.time,
        "now": now,
        "rfr": rf_run,
        "rfs": rf_step,
    }
    conn.execute(text(UPSERT_RUN), params)
    return None


def run_exists(conn: Connection, run_id: str) -> bool:
    return conn.execute(text("SELECT 1 FROM runs WHERE id=:id"), {"id": run_id}).first() is not None


def run_pk(conn: Connection, run_id: str, now: float) -> int:
    """The run's key; a run that sends before its run_start (HTTP ingest, a lost start)
    is created bare."""
    row = conn.execute(text("SELECT pk FROM runs WHERE id=:id"), {"id": run_id}).first()
    if row is None:
        row = conn.execute(
            text(
                "INSERT INTO runs(id, project, name, status, config, topology, command, "
                "started, updated, heartbeat) VALUES (:id, '', :id, 'running', '{}', '{}', "
                "'[]', :now, :now, :now) RETURNING pk"
            ),
            {"id": run_id, "now": now},
        ).first()
    return int(row[0])


def last_step(conn: Connection, pk: int) -> int | None:
    row = conn.execute(text("SELECT step FROM runs WHERE pk=:pk"), {"pk": pk}).first()
    return row[0] if row and row[0] is not None else None


def add_attempt(conn: Connection, pk: int, attempt: str, started: float) -> bool:
    """Record a launch of the run; False when its token was recorded already (a replay)."""
    return bool(
        conn.execute(
            text(
                "INSERT INTO run_attempts(run_pk, attempt, started) VALUES (:pk, :a, :t) "
                "ON CONFLICT DO NOTHING"
            ),
            {"pk": pk, "a": attempt, "t": started},
        ).rowcount
    )


def end_run(
    conn: Connection, pk: int, status: str, error: str | None, t: float | None, now: float
) -> None:
    """The run's end. A NUL in the error text (a traceback may hold one) becomes U+FFFD:
    PostgreSQL's text cannot hold it, and both backends store the same."""
    if error is not None:
        error = error.replace("\x00", "\ufffd")
    conn.execute(
        text(
            "UPDATE runs SET status=:s, error=:e, finished=:t, updated=:now, "
            "heartbeat=:now WHERE pk=:pk"
        ),
        {"s": status, "e": error, "t": t, "now": now, "pk": pk},
    )


def touch_run(conn: Connection, pk: int, now: float, step: int) -> None:
    """A sign of life: the heartbeat, and the newest step seen (-1: none in this batch)."""
    conn.execute(
        text(
            "UPDATE runs SET heartbeat=:now, updated=:now, "
            "step=CASE WHEN COALESCE(step, -1) > :st THEN step ELSE :st END WHERE pk=:pk"
        ),
        {"now": now, "st": step, "pk": pk},
    )


def metric_names(conn: Connection, pk: int) -> set[str]:
    return {r[0] for r in conn.exec_driver_sql("SELECT name FROM latest WHERE run_pk=?", (pk,))}


def insert_metrics(conn: Connection, rows: list[tuple]) -> None:
    """rows: (run_pk, name, step, value, time). Also the latest value of each series and
    the run's first non-finite step (the run list's NaN badge)."""
    if is_pg(conn):
        latest: dict[tuple[int, str, int], tuple] = {}
        for r in rows:  # one row per key: ON CONFLICT may not touch a row twice in a statement
            latest[(r[0], r[1], r[2])] = r
        conn.exec_driver_sql(INSERT_METRIC_ARRAYS, tuple(map(list, zip(*latest.values()))))
    else:
        conn.exec_driver_sql(INSERT_METRIC, rows)
    newest: dict[tuple[int, str], tuple] = {}
    for r in rows:  # one latest-row update per metric per batch, not per point
        k = (r[0], r[1])
        if k not in newest or r[2] >= newest[k][2]:
            newest[k] = r[:4]
    conn.exec_driver_sql(UPSERT_LATEST, list(newest.values()))
    bad = [(r[0], r[2], r[1]) for r in rows if not math.isfinite(r[3])]
    if bad:
        conn.exec_driver_sql(NONFINITE, bad)


def upsert_checkpoint(conn: Connection, run_pk: int, **f: Any) -> None:
    """Store a checkpoint with the key of its resolved path (relative to its run's cwd),
    computed once here: a resume finds it by that key (checkpoints.infer_resumed_from)."""
    cwd = conn.execute(text("SELECT cwd FROM runs WHERE pk=:pk"), {"pk": run_pk}).scalar()
    conn.execute(
        text(
            "INSERT INTO checkpoints(run_pk, step, path, consumed_tokens, topology, size, complete, "
            "created, source, path_key) VALUES (:pk, :step, :path, :ct, :topo, :size, :complete, "
            ":created, :source, :key) ON CONFLICT(run_pk, step) DO UPDATE SET path=excluded.path, "
            "path_key=excluded.path_key, "
            "consumed_tokens=COALESCE(excluded.consumed_tokens, checkpoints.consumed_tokens), "
            "topology=excluded.topology, size=COALESCE(excluded.size, checkpoints.size), "
            "complete=excluded.complete, created=COALESCE(excluded.created, checkpoints.created)"
        ),
        {
            "pk": run_pk,
            "step": f["step"],
            "path": f["path"],
            "ct": f.get("consumed_tokens"),
            "topo": json.dumps(f.get("topology") or {}),
            "size": f.get("size"),
            "complete": 1 if f.get("complete", True) else 0,
            "created": f.get("created"),
            "source": f.get("source", "message"),
            "key": key_of(f["path"], cwd),
        },
    )
