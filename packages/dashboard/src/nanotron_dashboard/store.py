"""The SQL each message becomes (run in the writer's transaction), and the result helpers."""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from .checkpoints import infer_resumed_from
from .messages import RunStart

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
DISK_FULL_LOG_EVERY_S = 60.0


def is_disk_full(e: BaseException) -> bool:
    orig = getattr(e, "orig", e)
    return isinstance(orig, sqlite3.OperationalError) and (
        getattr(orig, "sqlite_errorcode", None) == 13 or "disk is full" in str(orig)
    )


def refusal(status: int, error: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "status": status, "error": error, **extra}


def upsert_run(conn: Connection, m: RunStart, now: float) -> dict[str, Any] | None:
    """Create or refresh a run from its run_start; a refusal (409) when it would change the
    run's command, cwd or checkpoints path."""
    # The command, cwd and checkpoints path are what Resume runs: fixed by the first
    # run_start. The same one again (a replay after a restart) is fine; another is refused.
    prev = conn.execute(
        text("SELECT command, cwd, checkpoints_path FROM runs WHERE id=:id"), {"id": m.run_id}
    ).first()
    new = (json.dumps(m.command), m.cwd, m.checkpoints_path)
    if prev is not None and (prev[0] != "[]" or prev[1] or prev[2]) and tuple(prev) != new:
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
        "started": m.time,
        "now": now,
        "rfr": rf_run,
        "rfs": rf_step,
    }
    conn.execute(
        text(
            "INSERT INTO runs(id, project, name, status, config, world_size, topology, host, "
            "command, cwd, checkpoints_path, started, updated, heartbeat, resumed_from_run, "
            "resumed_from_step) VALUES (:id, :project, :name, 'running', :config, :ws, "
            ":topology, :host, :command, :cwd, :cp, :started, :now, :now, :rfr, :rfs) "
            "ON CONFLICT(id) DO UPDATE SET project=excluded.project, name=excluded.name, "
            "status='running', config=excluded.config, world_size=excluded.world_size, "
            "topology=excluded.topology, host=excluded.host, command=excluded.command, "
            "cwd=excluded.cwd, checkpoints_path=excluded.checkpoints_path, "
            "updated=:now, heartbeat=:now, finished=NULL, error=NULL, "
            "started=COALESCE(runs.started, excluded.started), "
            "resumed_from_run=COALESCE(excluded.resumed_from_run, runs.resumed_from_run), "
            "resumed_from_step=COALESCE(excluded.resumed_from_step, runs.resumed_from_step)"
        ),
        params,
    )
    return None


def upsert_checkpoint(conn: Connection, run_pk: int, **f: Any) -> None:
    conn.execute(
        text(
            "INSERT INTO checkpoints(run_pk, step, path, consumed_tokens, topology, size, complete, "
            "created, source) VALUES (:pk, :step, :path, :ct, :topo, :size, :complete, :created, "
            ":source) ON CONFLICT(run_pk, step) DO UPDATE SET path=excluded.path, "
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
        },
    )
