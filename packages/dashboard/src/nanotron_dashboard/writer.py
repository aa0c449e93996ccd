"""The single writer: one thread drains a queue of validated messages into SQLite.

Many trainers then never contend for SQLite's lock, and a burst of small messages becomes one
transaction. After each commit it tells the series cache and the live-update hub.

The queue is bounded in bytes (an estimate of the parsed messages' memory), not in count: a producer that
finds it full waits (websocket: its acks slow down) or is told to retry (HTTP 503).
Each message's result is a dict; a refusal is `{"ok": False, "status": 4xx/5xx, "error": ...}`
(a run_start that would change a run's command, a run's 1001st metric name, a full disk).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from . import store, telemetry_store
from .blocks import Sealer
from .messages import MAX_METRIC_NAMES, Checkpoint, Heartbeat, Metrics, RunEnd, RunStart
from .series import SeriesCache
from .store import DISK_FULL_LOG_EVERY_S, is_disk_full, refusal
from .telemetry_messages import TELEMETRY, Event, PipelineTimeline, RankStats, Samples
from .telemetry_store import EventDict, Side, StallCheck
from .writer_index import RunIndex

log = logging.getLogger("nanotron_dashboard")

Job = Callable[[Connection], Any]  # an arbitrary write, run inside the writer's transaction
Item = tuple[Any, Future | None, int]  # (message or job, its result, its size in bytes)
# (run_id -> points [(name, step, value, time)], runs whose summary changed,
#  run_id -> notices of telemetry stored for it)
Notify = Callable[
    [dict[str, list[tuple[str, int, float, float]]], set[str], dict[str, list[dict]]], None
]


class Writer:
    def __init__(
        self,
        engine: Engine,
        cache: SeriesCache,
        notify: Notify | None = None,
        watching: Callable[[str], bool] = lambda run_id: False,
        max_batch: int = 5000,
        max_bytes: int = 64 << 20,
        on_events: Callable[[list[EventDict]], None] | None = None,
    ) -> None:
        self._engine = engine
        self._cache = cache
        self._notify = notify
        self._on_events = on_events  # the webhook sender's enqueue: never blocks
        self._watching = watching  # whether a browser follows this run (it wants its points)
        self._max_batch = max_batch
        self.queue: queue.Queue[Item | None] = queue.Queue()
        self.max_bytes = max_bytes
        self._bytes = 0  # size of what is queued
        self._bytes_lock = threading.Lock()
        self.disk_full = False  # the last write failed for want of space
        self._disk_full_logged = 0.0
        self._index = RunIndex()  # run ids' pks, metric names of the runs written to now
        self._sealer = Sealer()  # keeps series_blocks in step with metrics
        self._thread = threading.Thread(target=self._run, name="dashboard-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.queue.put(None)
        self._thread.join(timeout)

    def submit(self, item: Any, want_result: bool = False) -> Future | None:
        """Queue a Job (or a message), whatever the queue holds: for the API's own writes."""
        fut: Future | None = Future() if want_result else None
        self.queue.put((item, fut, 0))
        return fut

    def try_put(self, items: list[tuple[Any, Future | None, int]]) -> bool:
        """Queue all of `items` or none: False when their bytes do not fit (back-pressure).

        An empty queue always takes one batch, so a message under the limit cannot starve.
        """
        size = sum(i[2] for i in items)
        with self._bytes_lock:
            if self._bytes and self._bytes + size > self.max_bytes:
                return False
            self._bytes += size
        for item in items:
            self.queue.put(item)
        return True

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def held(self) -> dict[str, int]:
        """What the writer keeps between batches (bounded), for the memory account."""
        runs, names = self._index.sizes()
        return {
            "runs": runs,
            "names": names,
            "series_bounds": len(self._sealer),
            "bytes": self._index.nbytes + self._sealer.nbytes,
        }

    # --- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        with self._engine.connect() as conn:
            while True:
                first = self.queue.get()
                if first is None:
                    return
                batch = [first]
                size = first[2]
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
                    size += nxt[2]
                    if size >= self.max_bytes // 4:  # a batch is a fair share of the budget
                        break
                try:
                    self._write_batch(conn, batch)
                finally:  # counted until written: a batch in hand is memory too
                    with self._bytes_lock:
                        self._bytes -= size
                if stop:
                    return

    def _forget(self, conn: Connection) -> None:
        """After a rollback the cached keys and bounds may be ahead of the database."""
        conn.rollback()
        self._index.clear()
        self._sealer.reset()

    def _write_batch(self, conn: Connection, batch: list[Item]) -> None:
        try:
            results, rows, changed, side = self._apply(conn, [m for m, _, _ in batch])
        except Exception as e:  # one bad item must not lose the batch: retry one by one
            self._forget(conn)
            if is_disk_full(e):
                self._on_disk_full(batch)
                return
            for item in batch:
                self._write_one(conn, item)
            return
        self.disk_full = False  # space came back: writes go on by themselves
        self._after_commit(rows, changed, side)
        for (_, fut, _), res in zip(batch, results):
            if fut is not None:
                fut.set_result(res)

    def _write_one(self, conn: Connection, item: Item) -> None:
        msg, fut, _ = item
        try:
            results, rows, changed, side = self._apply(conn, [msg])
        except Exception as e:
            self._forget(conn)
            if is_disk_full(e):
                self._on_disk_full([item])
                return
            log.exception("dashboard writer: dropped a message it could not store")
            if fut is not None:
                fut.set_exception(e)
            return
        self._after_commit(rows, changed, side)
        if fut is not None:
            fut.set_result(results[0])

    def _on_disk_full(self, batch: list[Item]) -> None:
        """Refuse the batch with 507; one log line a minute, not a traceback per message."""
        self.disk_full = True
        now = time.monotonic()
        if now - self._disk_full_logged >= DISK_FULL_LOG_EVERY_S:
            self._disk_full_logged = now
            log.error(
                "dashboard writer: the database's disk is full; refusing writes (507) until "
                "there is space again (this line repeats at most once a minute)"
            )
        res = refusal(507, "the dashboard's disk is full; retry later")
        for _, fut, _ in batch:
            if fut is not None:
                fut.set_result(res)

    def _after_commit(self, rows: list[tuple], changed: set[str], side: Side) -> None:
        """Hand the committed points to the cache and the hub, for the runs they watch, and
        new events to the webhook sender."""
        if side.events and self._on_events is not None:
            try:
                self._on_events(side.events)
            except Exception:
                log.exception("dashboard writer: handing events to the webhook sender failed")
        run_of = self._index.run_ids()
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
                self._notify(points, changed, side.notices)
            except Exception:
                log.exception("dashboard writer: live-update notification failed")

    def _apply(
        self, conn: Connection, msgs: list[Any]
    ) -> tuple[list[Any], list[tuple], set[str], Side]:
        now = time.time()
        side = Side()
        results: list[Any] = []
        rows: list[tuple] = []
        max_step: dict[str, int] = {}
        touched: set[str] = set()
        changed: set[str] = set()
        with conn.begin():
            for msg in msgs:
                if isinstance(msg, Metrics):
                    pk = self._pk(conn, msg.run_id, now)
                    refused = self._check_names(conn, pk, msg)
                    if refused is not None:
                        results.append(refused)
                        continue
                    step, t = msg.step, msg.time
                    rows.extend([(pk, name, step, value, t) for name, value in msg.values.items()])
                    max_step[msg.run_id] = max(max_step.get(msg.run_id, -1), msg.step)
                    touched.add(msg.run_id)
                    results.append({"ok": True})
                elif isinstance(msg, TELEMETRY):
                    self._telemetry(conn, msg, now, side)
                    touched.add(msg.run_id)  # a sign of life like a heartbeat
                    if isinstance(msg, Event):
                        changed.add(msg.run_id)  # the run list's event badges
                    results.append({"ok": True})
                elif isinstance(msg, RunStart):
                    res = self._run_start(conn, msg, now, side)
                    results.append(res)
                    if res["ok"]:
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
                elif isinstance(msg, StallCheck):
                    for ev in msg(conn, now):
                        side.event(ev)
                        changed.add(ev["run_id"])
                    results.append({"ok": True})
                elif callable(msg):
                    results.append(msg(conn))
                    self._index.clear()  # a job may have created or deleted runs
                    self._sealer.reset()
                else:
                    raise TypeError(f"unknown writer item {type(msg).__name__}")
            if rows:
                conn.exec_driver_sql(store.INSERT_METRIC, rows)
                self._sealer.after_insert(conn.connection.driver_connection, rows)
                newest: dict[tuple[int, str], tuple] = {}
                for r in rows:  # one latest-row update per metric per batch, not per point
                    k = (r[0], r[1])
                    if k not in newest or r[2] >= newest[k][2]:
                        newest[k] = r[:4]
                conn.exec_driver_sql(store.UPSERT_LATEST, list(newest.values()))
                bad = [(r[0], r[2], r[1]) for r in rows if not math.isfinite(r[3])]
                if bad:  # the run list's NaN badge: the first non-finite step of each run
                    conn.exec_driver_sql(store.NONFINITE, bad)
            for run_id in touched:
                conn.execute(
                    text(
                        "UPDATE runs SET heartbeat=:now, updated=:now, "
                        "step=MAX(COALESCE(step, -1), :st) WHERE pk=:pk"
                    ),
                    {"now": now, "st": max_step.get(run_id, -1), "pk": self._pk(conn, run_id, now)},
                )
        changed |= set(max_step)
        return results, rows, changed, side

    def _telemetry(self, conn: Connection, msg: Any, now: float, side: Side) -> None:
        pk = self._pk(conn, msg.run_id, now)
        if isinstance(msg, Event):
            side.event(telemetry_store.store_trainer_event(conn, pk, msg))
            return
        if isinstance(msg, RankStats):
            telemetry_store.store_rank_stats(conn, pk, msg)
        elif isinstance(msg, PipelineTimeline):
            telemetry_store.store_timeline(conn, pk, msg)
        elif isinstance(msg, Samples) and not telemetry_store.store_samples(conn, pk, msg):
            return  # a replay: nothing new to show
        notice = {"type": msg.type, "run_id": msg.run_id, "step": msg.step}
        side.notices.setdefault(msg.run_id, []).append(notice)

    def _pk(self, conn: Connection, run_id: str, now: float) -> int:
        pk = self._index.pk(run_id)
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
            pk = int(row[0])
            self._index.set_pk(run_id, pk)
        return pk

    def _check_names(self, conn: Connection, pk: int, msg: Metrics) -> dict[str, Any] | None:
        """At most MAX_METRIC_NAMES names per run: a message bringing more is refused whole."""
        names = self._index.names(pk)
        if names is None:
            names = {
                r[0] for r in conn.exec_driver_sql("SELECT name FROM latest WHERE run_pk=?", (pk,))
            }
            self._index.set_names(pk, names)
        new = [n for n in msg.values if n not in names]
        if len(names) + len(new) > MAX_METRIC_NAMES:
            return refusal(
                422,
                f"run {msg.run_id!r} would have {len(names) + len(new)} metric names, over "
                f"the limit of {MAX_METRIC_NAMES} (new here: {', '.join(new[:5])[:300]})",
            )
        self._index.add_names(pk, new)
        return None

    def _run_start(self, conn: Connection, m: RunStart, now: float, side: Side) -> dict[str, Any]:
        existed = conn.execute(text("SELECT 1 FROM runs WHERE id=:id"), {"id": m.run_id}).first()
        refused = store.upsert_run(conn, m, now)
        if refused is not None:
            return refused
        pk = self._pk(conn, m.run_id, now)
        row = conn.execute(text("SELECT step FROM runs WHERE pk=:pk"), {"pk": pk}).first()
        last = row[0] if row and row[0] is not None else None
        if m.attempt:  # a replayed run_start repeats its launch's token: counted once
            new = conn.execute(
                text(
                    "INSERT INTO run_attempts(run_pk, attempt, started) VALUES (:pk, :a, :t) "
                    "ON CONFLICT DO NOTHING"
                ),
                {"pk": pk, "a": m.attempt, "t": m.time or now},
            ).rowcount
            if new and existed is not None:  # a new launch of a run we know: a restart
                side.event(
                    telemetry_store.restart_event(
                        conn, pk, m.run_id, m.attempt, last, m.time or now
                    )
                )
        return {"ok": True, "type": "run_start", "run_id": m.run_id, "last_step": last}

    def _checkpoint(self, conn: Connection, m: Checkpoint, now: float) -> None:
        pk = self._pk(conn, m.run_id, now)
        store.upsert_checkpoint(
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
