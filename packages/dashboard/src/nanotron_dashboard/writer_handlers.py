"""What each message does inside the writer's transaction: a table from message type to handler.

A handler takes the connection, the message and the batch (what the transaction gathers for
after its commit) and returns the message's result dict; the SQL is in store.py and
telemetry_store.py. A new message type is its model, its store function and one entry here
(a telemetry message stored per step: an entry in telemetry_store.STORE is enough).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection

from . import store, telemetry_store
from .backend import Raw
from .blocks import Sealer
from .messages import MAX_METRIC_NAMES, Checkpoint, Heartbeat, Metrics, RunEnd, RunStart
from .store import refusal
from .telemetry_messages import Event
from .telemetry_store import Side, StallCheck
from .writer_index import RunIndex

Result = dict[str, Any]


@dataclass
class Batch:
    """One transaction's account, handed on after its commit."""

    now: float
    side: Side = field(default_factory=Side)  # live notices, new events
    rows: list[tuple] = field(default_factory=list)  # points (run_pk, name, step, value, time)
    max_step: dict[str, int] = field(default_factory=dict)  # newest metrics step per run
    touched: set[str] = field(default_factory=set)  # runs that showed a sign of life
    changed: set[str] = field(default_factory=set)  # runs whose run-list summary changed


Handler = Callable[[Connection, Any, Batch], Any]


class Handlers:
    """The handler of each message type, and the run keys and metric names they remember."""

    def __init__(self, index: RunIndex, sealer: Sealer) -> None:
        self.index = index
        self.sealer = sealer
        self.table: dict[type, Handler] = {
            Metrics: self.metrics,
            RunStart: self.run_start,
            Heartbeat: self.heartbeat,
            Checkpoint: self.checkpoint,
            RunEnd: self.run_end,
            Event: self.event,
            StallCheck: self.stall_check,
            **{kind: self.telemetry for kind in telemetry_store.STORE},
        }

    def handle(self, conn: Connection, msg: Any, b: Batch) -> Any:
        handler = self.table.get(type(msg))
        if handler is None:
            if not callable(msg):
                raise TypeError(f"unknown writer item {type(msg).__name__}")
            handler = self.job
        return handler(conn, msg, b)

    def finish(self, conn: Connection, b: Batch) -> None:
        """After the batch's messages: its points in one insert, then each run's heartbeat."""
        if b.rows:
            store.insert_metrics(conn, b.rows)
            self.sealer.after_insert(Raw(conn), b.rows)
        for run_id in b.touched:
            pk = self.pk(conn, run_id, b.now)
            store.touch_run(conn, pk, b.now, b.max_step.get(run_id, -1))
        b.changed |= set(b.max_step)

    def pk(self, conn: Connection, run_id: str, now: float) -> int:
        pk = self.index.pk(run_id)
        if pk is None:
            pk = store.run_pk(conn, run_id, now)
            self.index.set_pk(run_id, pk)
        return pk

    # --- the handlers -------------------------------------------------------------------
    def metrics(self, conn: Connection, m: Metrics, b: Batch) -> Result:
        pk = self.pk(conn, m.run_id, b.now)
        refused = self._check_names(conn, pk, m)
        if refused is not None:
            return refused
        b.rows.extend([(pk, name, m.step, value, m.time) for name, value in m.values.items()])
        b.max_step[m.run_id] = max(b.max_step.get(m.run_id, -1), m.step)
        b.touched.add(m.run_id)
        return {"ok": True}

    def telemetry(self, conn: Connection, m: Any, b: Batch) -> Result:
        pk = self.pk(conn, m.run_id, b.now)
        b.touched.add(m.run_id)  # a sign of life like a heartbeat
        stored = telemetry_store.STORE[type(m)](conn, pk, m)
        if isinstance(stored, dict):  # refused (over a bound across messages)
            return stored
        if stored:  # not a replay: the pages are told
            notice = {"type": m.type, "run_id": m.run_id, "step": m.step}
            b.side.notices.setdefault(m.run_id, []).append(notice)
        return {"ok": True}

    def event(self, conn: Connection, m: Event, b: Batch) -> Result:
        pk = self.pk(conn, m.run_id, b.now)
        b.side.event(telemetry_store.store_trainer_event(conn, pk, m))
        b.touched.add(m.run_id)
        b.changed.add(m.run_id)  # the run list's event badges
        return {"ok": True}

    def run_start(self, conn: Connection, m: RunStart, b: Batch) -> Result:
        existed = store.run_exists(conn, m.run_id)
        refused = store.upsert_run(conn, m, b.now)
        if refused is not None:
            return refused
        pk = self.pk(conn, m.run_id, b.now)
        last = store.last_step(conn, pk)
        t = m.time or b.now
        # a replayed run_start repeats its launch's token: counted once; a new launch of a
        # run we know is a restart
        if m.attempt and store.add_attempt(conn, pk, m.attempt, t) and existed:
            b.side.event(telemetry_store.restart_event(conn, pk, m.run_id, m.attempt, last, t))
        b.changed.add(m.run_id)
        return {"ok": True, "type": "run_start", "run_id": m.run_id, "last_step": last}

    def heartbeat(self, conn: Connection, m: Heartbeat, b: Batch) -> Result:
        b.touched.add(m.run_id)
        self.pk(conn, m.run_id, b.now)
        return {"ok": True}

    def checkpoint(self, conn: Connection, m: Checkpoint, b: Batch) -> Result:
        store.upsert_checkpoint(
            conn,
            self.pk(conn, m.run_id, b.now),
            step=m.step,
            path=m.path,
            consumed_tokens=m.consumed_tokens,
            topology=m.topology,
            size=m.size,
            complete=m.complete,
            created=m.created or b.now,
            source="message",
        )
        b.changed.add(m.run_id)
        return {"ok": True}

    def run_end(self, conn: Connection, m: RunEnd, b: Batch) -> Result:
        store.end_run(conn, self.pk(conn, m.run_id, b.now), m.status, m.error, m.time, b.now)
        b.changed.add(m.run_id)
        return {"ok": True}

    def stall_check(self, conn: Connection, check: StallCheck, b: Batch) -> Result:
        for ev in check(conn, b.now):
            b.side.event(ev)
            b.changed.add(ev["run_id"])
        return {"ok": True}

    def job(self, conn: Connection, job: Callable[[Connection], Any], b: Batch) -> Any:
        """An arbitrary write from the API: it may create or delete runs, so the remembered
        keys and bounds are dropped."""
        result = job(conn)
        self.index.clear()
        self.sealer.reset()
        return result

    def _check_names(self, conn: Connection, pk: int, m: Metrics) -> Result | None:
        """At most MAX_METRIC_NAMES names per run: a message bringing more is refused whole."""
        names = self.index.names(pk)
        if names is None:
            names = store.metric_names(conn, pk)
            self.index.set_names(pk, names)
        new = [n for n in m.values if n not in names]
        if len(names) + len(new) > MAX_METRIC_NAMES:
            return refusal(
                422,
                f"run {m.run_id!r} would have {len(names) + len(new)} metric names, over "
                f"the limit of {MAX_METRIC_NAMES} (new here: {', '.join(new[:5])[:300]})",
            )
        self.index.add_names(pk, new)
        return None
