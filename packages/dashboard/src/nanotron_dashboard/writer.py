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
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from typing import Any

from sqlalchemy.engine import Connection, Engine

from .blocks import Sealer
from .outage import Outage, is_unavailable, unavailable
from .series import SeriesCache
from .store import DISK_FULL_LOG_EVERY_S, is_disk_full, refusal
from .telemetry_store import EventDict, Side
from .writer_handlers import Batch, Handlers
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
        db_lock: Any = None,
        redact: Callable[[str], str] = str,
    ) -> None:
        self._engine = engine
        # PostgreSQL: the one-server lock's connection, which the writer writes on, so that
        # no commit happens on a session without the lock (backend.PgLock); SQLite: None
        self._db_lock = db_lock
        self.outage = Outage(redact)  # the database out of reach: 503s, two log lines
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
        self._handlers = Handlers(self._index, self._sealer)  # message type -> its writes
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
        session = self._db_lock.connection() if self._db_lock else self._engine.connect()
        with session as conn:
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
        try:
            conn.rollback()
        except Exception:  # the connection is gone: the next batch opens another
            with suppress(Exception):
                conn.invalidate()
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
            if is_unavailable(e):
                self._on_unavailable(conn, batch, e)
                return
            for item in batch:
                self._write_one(conn, item)
            return
        self.disk_full = False  # space came back: writes go on by themselves
        self.outage.ok()
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
            if is_unavailable(e):
                self._on_unavailable(conn, [item], e)
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

    def _on_unavailable(self, conn: Connection, batch: list[Item], e: Exception) -> None:
        """The database is out of reach (or another server took its lock): the batch is
        refused with 503 and Retry-After, nothing of it stored, so nothing acked is lost. The
        connection is dropped: the next batch opens a new one (and takes the lock again)."""
        with suppress(Exception):
            conn.invalidate()
        self.outage.failed(e)
        res = unavailable(e)
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
        """One transaction: each message through its type's handler (writer_handlers.py)."""
        b = Batch(now=time.time())
        if self._db_lock is not None:
            self._db_lock.hold(conn)  # this session holds the lock, or LockLost
        with conn.begin():
            results = [self._handlers.handle(conn, msg, b) for msg in msgs]
            self._handlers.finish(conn, b)
        return results, b.rows, b.changed, b.side
