"""The single writer: one thread drains a queue of validated messages into SQLite.

Many trainers then never contend for SQLite's lock, and a burst of small messages becomes one
transaction. After each commit it tells the series cache and the live-update hub.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from .blocks import Sealer
from .checkpoints import infer_resumed_from
from .messages import Checkpoint, Heartbeat, Metrics, RunEnd, RunStart
from .series import SeriesCache

log = logging.getLogger("nanotron_dashboard")

Job = Callable[[Connection], Any]  # an arbitrary write, run inside the writer's transaction
Item = tuple[Any, Future | None]
# (run_id, points [(name, step, value, time)], summary_changed)
Notify = Callable[[dict[str, list[tuple[str, int, float, float]]], set[str]], None]

_INSERT_METRIC = (
    "INSERT INTO metrics(run_pk, name, step, value, time) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT(run_pk, name, step) DO UPDATE SET value=excluded.value, time=excluded.time"
)
_UPSERT_LATEST = (
    "INSERT INTO latest(run_pk, name, step, value) VALUES (?, ?, ?, ?) "
    "ON CONFLICT(run_pk, name) DO UPDATE SET step=excluded.step, value=excluded.value "
    "WHERE excluded.step >= latest.step"
)


class Writer:
    def __init__(
        self,
        engine: Engine,
        cache: SeriesCache,
        notify: Notify | None = None,
        watching: Callable[[str], bool] = lambda run_id: False,
        max_batch: int = 5000,
        max_queue: int = 200_000,
    ) -> None:
        self._engine = engine
        self._cache = cache
        self._notify = notify
        self._watching = watching  # whether a browser follows this run (it wants its points)
        self._max_batch = max_batch
        self.queue: queue.Queue[Item | None] = queue.Queue(maxsize=max_queue)
        self._pks: dict[str, int] = {}
        self._sealer = Sealer()  # keeps series_blocks in step with metrics
        self._thread = threading.Thread(target=self._run, name="dashboard-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.queue.put(None)
        self._thread.join(timeout)

    def submit(self, item: Any, want_result: bool = False) -> Future | None:
        """Queue a message (or a Job); blocks only when the queue is full (back-pressure)."""
        fut: Future | None = Future() if want_result else None
        self.queue.put((item, fut))
        return fut

    # --- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        with self._engine.connect() as conn:
            while True:
                first = self.queue.get()
                if first is None:
                    return
                batch = [first]
                stop = False
                while len(batch) < self._max_batch:
                    try:
                        nxt = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        stop = True
                        break
                    batch.append(nxt)
                self._write_batch(conn, batch)
                if stop:
                    return

    def _write_batch(self, conn: Connection, batch: list[Item]) -> None:
        try:
            results, rows, changed = self._apply(conn, [m for m, _ in batch])
        except Exception:  # one bad item must not lose the batch: retry one by one
            conn.rollback()
            self._pks.clear()
            self._sealer.reset()
            for item in batch:
                self._write_one(conn, item)
            return
        self._after_commit(rows, changed)
        for (_, fut), res in zip(batch, results):
            if fut is not None:
                fut.set_result(res)

    def _write_one(self, conn: Connection, item: Item) -> None:
        msg, fut = item
        try:
            results, rows, changed = self._apply(conn, [msg])
        except Exception as e:
            conn.rollback()
            self._pks.clear()
            self._sealer.reset()
            log.exception("dashboard writer: dropped a message it could not store")
            if fut is not None:
                fut.set_exception(e)
            return
        self._after_commit(rows, changed)
        if fut is not None:
            fut.set_result(results[0])

    def _after_commit(self, rows: list[tuple], changed: set[str]) -> None:
        """Hand the committed points to the cache and the hub, for the runs they watch."""
        run_of = {pk: rid for rid, pk in self._pks.items()}
        watched = self._cache.run_pks() | {pk for pk, rid in run_of.items() if self._watching(rid)}
        by_key: dict[tuple[int, str], tuple[list, list, list]] = {}
        points: dict[str, list[tuple[str, int, float, float]]] = {}
        if watched:
            for pk, name, step, value, t in sorted(
                (r for r in rows if r[0] in watched), key=lambda r: (r[0], r[1], r[2])
            ):
                s, v, tt = by_key.setdefault((pk, name), ([], [], []))
                if s and s[-1] == step:  # same step twice in one batch: the last one wins
                    v[-1], tt[-1] = value, t
                else:
                    s.append(step)
                    v.append(value)
                    tt.append(t)
                points.setdefault(run_of[pk], []).append((name, step, value, t))
        self._cache.on_commit(by_key)
        if self._notify is not None:
            try:
                self._notify(points, changed)
            except Exception:
                log.exception("dashboard writer: live-update notification failed")

    def _apply(self, conn: Connection, msgs: list[Any]) -> tuple[list[Any], dict, set[str]]:
        now = time.time()
        results: list[Any] = []
        rows: list[tuple] = []
        max_step: dict[str, int] = {}
        touched: set[str] = set()
        changed: set[str] = set()
        with conn.begin():
            for msg in msgs:
                if isinstance(msg, Metrics):
                    pk = self._pk(conn, msg.run_id, now)
                    step, t = msg.step, msg.time
                    rows.extend([(pk, name, step, value, t) for name, value in msg.values.items()])
                    max_step[msg.run_id] = max(max_step.get(msg.run_id, -1), msg.step)
                    touched.add(msg.run_id)
                    results.append({"ok": True})
                elif isinstance(msg, RunStart):
                    results.append(self._run_start(conn, msg, now))
                    changed.add(msg.run_id)
                elif isinstance(msg, Checkpoint):
                    self._checkpoint(conn, msg, now)
                    changed.add(msg.run_id)
                    results.append({"ok": True})
                elif isinstance(msg, Heartbeat):
                    touched.add(msg.run_id)
                    self._pk(conn, msg.run_id, now)
                    results.append({"ok": True})
                elif isinstance(msg, RunEnd):
                    pk = self._pk(conn, msg.run_id, now)
                    conn.execute(
                        text(
                            "UPDATE runs SET status=:s, error=:e, finished=:t, updated=:now, "
                            "heartbeat=:now WHERE pk=:pk"
                        ),
                        {"s": msg.status, "e": msg.error, "t": msg.time, "now": now, "pk": pk},
                    )
                    changed.add(msg.run_id)
                    results.append({"ok": True})
                elif callable(msg):
                    results.append(msg(conn))
                    self._pks.clear()  # a job may have created or deleted runs
                else:
                    raise TypeError(f"unknown writer item {type(msg).__name__}")
            if rows:
                conn.exec_driver_sql(_INSERT_METRIC, rows)
                self._sealer.after_insert(conn.connection.driver_connection, rows)
                newest: dict[tuple[int, str], tuple] = {}
                for r in rows:  # one latest-row update per metric per batch, not per point
                    k = (r[0], r[1])
                    if k not in newest or r[2] >= newest[k][2]:
                        newest[k] = r[:4]
                conn.exec_driver_sql(_UPSERT_LATEST, list(newest.values()))
            for run_id in touched:
                conn.execute(
                    text(
                        "UPDATE runs SET heartbeat=:now, updated=:now, "
                        "step=MAX(COALESCE(step, -1), :st) WHERE pk=:pk"
                    ),
                    {"now": now, "st": max_step.get(run_id, -1), "pk": self._pks[run_id]},
                )
        changed |= set(max_step)
        return results, rows, changed

    def _pk(self, conn: Connection, run_id: str, now: float) -> int:
        pk = self._pks.get(run_id)
        if pk is None:
            row = conn.execute(text("SELECT pk FROM runs WHERE id=:id"), {"id": run_id}).first()
            if row is None:  # metrics before run_start (HTTP ingest, lost start): a bare run
                row = conn.execute(
                    text(
                        "INSERT INTO runs(id, project, name, status, config, topology, command, "
                        "started, updated, heartbeat) VALUES (:id, '', :id, 'running', '{}', '{}', "
                        "'[]', :now, :now, :now) RETURNING pk"
                    ),
                    {"id": run_id, "now": now},
                ).first()
            pk = self._pks[run_id] = int(row[0])
        return pk

    def _run_start(self, conn: Connection, m: RunStart, now: float) -> dict[str, Any]:
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
        pk = self._pk(conn, m.run_id, now)
        row = conn.execute(text("SELECT step FROM runs WHERE pk=:pk"), {"pk": pk}).first()
        last = row[0] if row and row[0] is not None else None
        return {"ok": True, "type": "run_start", "run_id": m.run_id, "last_step": last}

    def _checkpoint(self, conn: Connection, m: Checkpoint, now: float) -> None:
        pk = self._pk(conn, m.run_id, now)
        upsert_checkpoint(
            conn,
            pk,
            step=m.step,
            path=m.path,
            consumed_tokens=m.consumed_tokens,
            topology=m.topology,
            size=m.size,
            complete=m.complete,
            created=m.created or now,
            source="message",
        )


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
