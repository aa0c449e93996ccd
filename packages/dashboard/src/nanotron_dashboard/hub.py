"""Live updates to browsers: per-run point streams and a run-list change feed."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from .messages import json_float

Points = dict[str, list[tuple[str, int, float, float]]]


class Hub:
    """Lives on the server's event loop; the writer thread calls `notify` after each commit."""

    def __init__(self, queue_size: int = 1000) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runs: dict[str, set[asyncio.Queue]] = {}
        self._list: set[asyncio.Queue] = set()
        self._queue_size = queue_size

    def subscribe(self, run_id: str | None) -> asyncio.Queue:
        self.loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue(self._queue_size)
        (self._list if run_id is None else self._runs.setdefault(run_id, set())).add(q)
        return q

    def unsubscribe(self, run_id: str | None, q: asyncio.Queue) -> None:
        subs = self._list if run_id is None else self._runs.get(run_id, set())
        subs.discard(q)
        if run_id is not None and not subs:
            self._runs.pop(run_id, None)

    def feeds(self) -> int:
        """Runs with a live subscriber (an entry leaves with its last subscriber)."""
        return len(self._runs)

    def watching(self, run_id: str) -> bool:
        return run_id in self._runs

    def notify(
        self, points: Points, changed: set[str], notices: dict[str, list[dict]] | None = None
    ) -> None:
        """Thread-safe entry point (called from the writer thread).

        `notices`: per run, small dicts saying what telemetry arrived (type and step; an
        event's id, kind and severity), never the payload: the page fetches what it shows,
        so a subscriber's queue stays small whatever the trainer sends."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        wanted = {r: p for r, p in points.items() if r in self._runs}
        notes = {r: n for r, n in (notices or {}).items() if r in self._runs}
        if not wanted and not notes and not (changed and self._list):
            return
        with contextlib.suppress(RuntimeError):  # loop shutting down
            loop.call_soon_threadsafe(self._publish, wanted, set(changed), notes)

    def _publish(
        self, points: Points, changed: set[str], notices: dict[str, list[dict]] | None = None
    ) -> None:
        for run_id, notes in (notices or {}).items():
            for note in notes:
                self._put(self._runs.get(run_id, ()), {**note, "run_id": run_id})
        for run_id, pts in points.items():
            by_name: dict[str, list[Any]] = {}
            for name, step, value, t in pts:
                by_name.setdefault(name, []).append([step, json_float(value), t])
            self._put(
                self._runs.get(run_id, ()), {"type": "points", "run_id": run_id, "points": by_name}
            )
        if changed:
            self._put(self._list, {"type": "runs_changed", "ids": sorted(changed)})
            for run_id in changed:
                self._put(self._runs.get(run_id, ()), {"type": "run_changed", "run_id": run_id})

    @staticmethod
    def _put(subs: Any, msg: dict[str, Any]) -> None:
        for q in list(subs):
            # a stalled browser misses points; it refetches on reconnect
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(msg)
