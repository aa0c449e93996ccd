"""The trainer's side of the dashboard: a background sender that training never waits on.

This module is the queue and its accounting (controls never dropped, metrics replayed after an
overflow, telemetry bounded) and the sender thread; dashboard_transport.py opens the websocket
and logs refusals, dashboard_spool.py reads back what to replay.

Messages go into an in-memory queue; a daemon thread sends them over the dashboard's
websocket (`/ws/ingest`). If the dashboard is down, slow, restarted or the URL is wrong, the
client logs one warning and keeps retrying; metrics that did not fit in the queue or were
lost in flight are replayed on reconnect from the metrics file (JSON lines, one record per
logged step), which the dashboard stores idempotently (a (run, metric, step) key). A record's
expert loads (`moe_load`) travel as telemetry, each sent before its step's metrics, and are
replayed with their record: a dropped one triggers the replay, a stored step has its loads.
No torch import: this module runs on any rank's CPU side.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections import deque
from typing import Any

from nanotron_train.reporting.dashboard_spool import (
    LOAD_KEY,
    jsonable,
    moe_load_message,
    records_after,
    spooled,
)
from nanotron_train.reporting.dashboard_transport import Refusals, ingest_url, open_ingest

log = logging.getLogger("nanotron_train.dashboard")
__all__ = ["DashboardClient", "ingest_url"]

_CONTROL = "control"
_METRICS = "metrics"
_TELEMETRY = "telemetry"  # rank_stats, pipeline_timeline: the oldest dropped past a bound
_LOADS = "loads"  # moe_load: bounded as telemetry, but replayed from the spool once dropped


class DashboardClient:
    def __init__(
        self,
        url: str,
        *,
        run_id: str,
        token: str | None = None,
        metrics_file: str | None = None,
        start_offset: int = 0,
        queue_size: int = 10000,
        heartbeat_s: float = 10.0,
    ) -> None:
        self.url = url
        # The metrics file is appended to across launches (a resumed run, a second `make run`):
        # only what this launch wrote, from byte `start_offset` on, is replayed as this run's.
        self.start_offset = start_offset
        self.ws_url = ingest_url(url)
        self.run_id = run_id
        self.token = token
        self.metrics_file = metrics_file
        self.queue_size = queue_size
        self.heartbeat_s = heartbeat_s
        self._items: deque[tuple[str, dict[str, Any]]] = deque()
        self._n_metrics = 0  # metrics items in _items; controls are never dropped
        self._n_telemetry = 0
        self.telemetry_queue = 256  # while the dashboard is away: bounded memory
        self.dropped_telemetry = 0
        self._cv = threading.Condition()
        self._overflow = False  # metrics were dropped: replay from the file before going on
        self._history: deque[dict[str, Any]] | None = (
            None if metrics_file else deque(maxlen=max(queue_size, 1000))
        )
        self._history_loads: deque[dict[str, Any]] = deque()  # the history's records with loads
        self.history_loads = 256  # of which the newest keep them: bounded memory
        self._start_msg: dict[str, Any] | None = None
        self._max_sent = -1
        self._closing = False
        self._deadline = 0.0
        self._warned = False
        self._ws: Any = None
        self.sent = 0  # messages sent (for tests and the final log line)
        self._refusals = Refusals()
        self._thread = threading.Thread(target=self._loop, name="dashboard-client", daemon=True)
        self._thread.start()

    # --- called by the trainer (never blocks) -------------------------------------------
    def run_start(
        self,
        *,
        project: str,
        name: str,
        config: dict,
        world_size: int,
        topology: dict,
        command: list[str],
        cwd: str,
        checkpoints_path: str | None,
        resumed_from: dict | None = None,
        attempt: str | None = None,
    ) -> None:
        msg = {
            "type": "run_start",
            "run_id": self.run_id,
            "project": project,
            "name": name,
            "config": json.loads(json.dumps(config, default=str)),
            "world_size": world_size,
            "topology": topology,
            "host": socket.gethostname(),
            "command": list(command),
            "cwd": cwd,
            "checkpoints_path": checkpoints_path,
            "resumed_from": resumed_from,
            "attempt": attempt,  # this launch; a restarted one continuing the run sends another
            "time": time.time(),
        }
        with self._cv:
            self._start_msg = msg  # re-sent on every (re)connect; its reply drives the replay
            self._items.append((_CONTROL, msg))
            self._cv.notify()

    def metrics(self, step: int, values: dict) -> None:
        """A logged step's record: its scalars, and its expert loads (`moe_load`) if any."""
        rec = spooled(step, values)
        loads = rec.pop(LOAD_KEY, None)  # queued apart: bounded as telemetry
        with self._cv:
            if self._history is not None:
                self._remember(rec, loads)
            if self._n_metrics >= self.queue_size:
                self._overflow = True  # the file (or history) has it; replayed later
                return
            if loads is not None:
                msg = moe_load_message(rec["step"], time.time(), loads)
                self._bounded(_LOADS, {**msg, "run_id": self.run_id})
            self._items.append((_METRICS, rec))
            self._n_metrics += 1
            self._cv.notify()

    def checkpoint(self, info: dict) -> None:
        self._control({"type": "checkpoint", "run_id": self.run_id, **info})

    def event(
        self,
        kind: str,
        severity: str,
        message: str,
        step: int | None,
        details: dict | None = None,
    ) -> None:
        """An `event` (straggler, loss spike, ...): kept until sent, like checkpoints."""
        self._control(
            {
                "type": "event",
                "run_id": self.run_id,
                "step": step,
                "time": time.time(),
                "kind": kind,
                "severity": severity,
                "message": message[:2000],
                "details": details or {},
            }
        )

    def prediction(self, msg: dict) -> None:
        """The layout planner's `prediction` of the run (sent once at start): kept until sent,
        like checkpoints, not dropped as the oldest telemetry while the dashboard is away."""
        self._control({**msg, "type": "prediction", "run_id": self.run_id})

    def samples(self, msg: dict) -> None:
        """A `samples` message (type and run_id are added); kept until sent."""
        self._control({"type": "samples", "run_id": self.run_id, **msg})

    def telemetry(self, msg: dict) -> None:
        """A `rank_stats` or `pipeline_timeline` message (with its `type`; run_id added).
        Past `telemetry_queue` waiting ones (the dashboard is away) the oldest is dropped:
        a heatmap with a gap is better than a trainer whose memory grows."""
        with self._cv:
            self._bounded(_TELEMETRY, {**msg, "run_id": self.run_id})
            self._cv.notify()

    def _bounded(self, kind: str, msg: dict[str, Any]) -> None:
        """Queue a telemetry or loads item (holding the lock), dropping the oldest such item
        past `telemetry_queue`; a dropped moe_load is replayed with its record instead."""
        if self._n_telemetry >= self.telemetry_queue:
            for i, (old, _) in enumerate(self._items):
                if old in (_TELEMETRY, _LOADS):
                    del self._items[i]
                    self._n_telemetry -= 1
                    self.dropped_telemetry += 1
                    self._overflow |= old == _LOADS
                    break
        self._items.append((kind, msg))
        self._n_telemetry += 1

    def _remember(self, rec: dict[str, Any], loads: dict | None) -> None:
        """Keep a record for replay without a metrics file (holding the lock); its loads only
        for the newest `history_loads` records, so memory stays bounded."""
        self._history.append({**rec, LOAD_KEY: loads} if loads is not None else rec)
        if loads is not None:
            self._history_loads.append(self._history[-1])
            if len(self._history_loads) > self.history_loads:
                self._history_loads.popleft().pop(LOAD_KEY, None)

    def run_end(self, status: str, error: str | None = None) -> None:
        self._control({"type": "run_end", "run_id": self.run_id, "status": status, "error": error})

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to `timeout` seconds), then stop the thread."""
        with self._cv:
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._cv.notify()
        self._thread.join(timeout + 1.0)

    def _control(self, msg: dict[str, Any]) -> None:
        with self._cv:
            self._items.append((_CONTROL, json.loads(json.dumps(msg, default=str))))
            self._cv.notify()

    # --- the sender thread --------------------------------------------------------------
    def _loop(self) -> None:
        backoff = 0.5
        last_send = 0.0
        while True:
            with self._cv:
                if self._closing and (not self._items or time.monotonic() > self._deadline):
                    break
            if self._ws is None:
                if not self._connect():
                    if self._closing:
                        break  # dashboard unreachable at close: nothing more to do
                    self._sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                backoff = 0.5
            with self._cv:
                if not self._items and not self._closing:
                    self._cv.wait(max(0.05, self.heartbeat_s - (time.monotonic() - last_send)))
                item = self._items[0] if self._items else None
                overflow = self._overflow
            try:
                if overflow:
                    with self._cv:
                        self._overflow = False
                    self._replay()
                if item is not None:
                    self._send_item(item)
                    with self._cv:
                        if self._items and self._items[0] is item:
                            self._items.popleft()
                            if item[0] == _METRICS:
                                self._n_metrics -= 1
                            elif item[0] in (_TELEMETRY, _LOADS):
                                self._n_telemetry -= 1
                    last_send = time.monotonic()
                elif time.monotonic() - last_send >= self.heartbeat_s and self._start_msg:
                    self._send({"type": "heartbeat", "run_id": self.run_id, "time": time.time()})
                    last_send = time.monotonic()
                self._drain_replies()
            except Exception as e:  # connection lost: reconnect, then replay what was missed
                self._disconnect(e)
        self._sync()
        self._disconnect(None)

    def _sync(self) -> None:
        """At close: wait (briefly) until the dashboard has committed everything sent."""
        if self._ws is None or self._start_msg is None:
            return
        try:
            self._send({"type": "heartbeat", "run_id": self.run_id, "time": time.time(), "ack": 1})
            deadline = time.monotonic() + max(0.1, self._deadline - time.monotonic())
            while time.monotonic() < deadline:
                reply = json.loads(self._ws.recv(timeout=max(0.05, deadline - time.monotonic())))
                if reply.get("type") == "ack":
                    return
                self._log_reply(reply)
        except Exception:
            return

    def _sleep(self, s: float) -> None:
        with self._cv:
            if not self._closing:
                self._cv.wait(s)

    def _handshake(self) -> None:
        """Send run_start, learn the last step the dashboard holds, replay everything after it."""
        assert self._start_msg is not None
        self._send(self._start_msg)
        deadline = time.monotonic() + 10
        while True:
            reply = json.loads(self._ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("type") == "run_start":
                break
            self._log_reply(reply)
        self._log_reply(reply)  # a refused run_start (409: the run id holds another command)
        last = reply.get("last_step")
        self._max_sent = -1 if last is None else int(last)
        with self._cv:  # a queued run_start was just sent
            if self._items and self._items[0][1] is self._start_msg:
                self._items.popleft()
        self._replay()

    def _records_after(self, step: int) -> list[dict[str, Any]]:
        with self._cv:
            history = list(self._history) if self._history is not None else None
        return records_after(step, self.metrics_file, self.start_offset, history)

    def _connect(self) -> bool:
        try:
            ws = open_ingest(self.ws_url, self.token)
        except Exception as e:
            self._warn(f"dashboard at {self.url} unreachable ({e}); training continues, retrying")
            return False
        self._ws = ws
        try:
            if self._start_msg is not None:
                self._handshake()
        except Exception as e:
            self._disconnect(e)
            return False
        if self._warned:
            log.info("dashboard at %s reachable again; replayed missed points", self.url)
        return True

    @property
    def refused(self) -> int:
        """Messages the dashboard refused (error frames)."""
        return self._refusals.count

    def _log_reply(self, reply: dict[str, Any]) -> None:
        self._refusals.note(reply)

    def _replay(self) -> None:
        for rec in self._records_after(self._max_sent):
            self._send_metrics(rec)

    def _send_item(self, item: tuple[str, dict[str, Any]]) -> None:
        kind, msg = item
        if kind in (_METRICS, _LOADS):
            if msg["step"] > self._max_sent:  # else replayed already (loads with their record)
                (self._send_metrics if kind == _METRICS else self._send)(msg)
        elif msg is not self._start_msg or self._max_sent < 0:
            self._send(msg)

    def _send_metrics(self, rec: dict[str, Any]) -> None:
        loads = rec.get(LOAD_KEY)  # a replayed record's: before its scalars, as when live
        if loads is not None:
            self._send({**moe_load_message(rec["step"], time.time(), loads), "run_id": self.run_id})
        values = {k: jsonable(v) for k, v in rec.items() if k not in ("step", LOAD_KEY)}
        if values:
            self._send(
                {
                    "type": "metrics",
                    "run_id": self.run_id,
                    "step": rec["step"],
                    "values": values,
                    "time": time.time(),
                }
            )
        self._max_sent = max(self._max_sent, rec["step"])

    def _send(self, msg: dict[str, Any]) -> None:
        self._ws.send(json.dumps(msg))
        self.sent += 1

    def _drain_replies(self) -> None:
        while True:
            try:
                raw = self._ws.recv(timeout=0)
            except TimeoutError:
                return
            self._log_reply(json.loads(raw))

    def _disconnect(self, err: Exception | None) -> None:
        if err is not None:
            self._warn(
                f"lost the dashboard at {self.url} ({err}); training continues, reconnecting"
            )
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                ws.close()

    def _warn(self, text: str) -> None:
        if not self._warned:  # one warning, not one per step
            self._warned = True
            log.warning(text)
