"""The pipeline timeline of one step: when each forward and backward ran on this stage.

The trainer passes a `TimelineRecorder` to the schedule for the one step it records (every
`logging.pipeline_timeline_interval` steps); every other step gets `NO_RECORDER`, whose spans
do nothing. Times are milliseconds from the recorder's creation, which the trainer places right
after a barrier of every rank, so the stages share one origin (to the barrier's skew).
On a GPU a span is a pair of CUDA events read once by `spans()` (one synchronization on the
recorded step only); on the CPU two `perf_counter` reads.
"""

from __future__ import annotations

import time

import torch

from nanotron_parallel.phase_timer import NO_SPAN


class _Span:
    __slots__ = ("key", "recorder", "start")

    def __init__(self, recorder: TimelineRecorder, key: tuple[str, int, int]) -> None:
        self.recorder, self.key = recorder, key

    def __enter__(self) -> None:
        self.start = self.recorder._now()

    def __exit__(self, *exc) -> bool:
        self.recorder._raw.append((self.key, self.start, self.recorder._now()))
        return False


class TimelineRecorder:
    def __init__(self, device: torch.device) -> None:
        self.on_device = device.type == "cuda"
        self.device = device
        self._raw: list[tuple[tuple[str, int, int], object, object]] = []
        self._t0 = self._now()

    def _now(self):
        if self.on_device:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def span(self, kind: str, micro_batch: int, chunk: int) -> _Span:
        """Times one `kind` ("forward" or "backward") of (micro_batch, chunk)."""
        return _Span(self, (kind, micro_batch, chunk))

    def spans(self) -> list[dict]:
        """[{kind, micro_batch, chunk, start_ms, end_ms}] in the order they ran."""
        if self.on_device:
            torch.cuda.synchronize(self.device)

        def ms(t) -> float:
            if self.on_device:
                return self._t0.elapsed_time(t)
            return (t - self._t0) * 1000.0

        return [
            {"kind": k, "micro_batch": mb, "chunk": c, "start_ms": ms(a), "end_ms": ms(b)}
            for (k, mb, c), a, b in self._raw
        ]


class _NoRecorder:
    """What every step that is not recorded gets: spans that do nothing."""

    def span(self, kind: str, micro_batch: int, chunk: int):
        return NO_SPAN


NO_RECORDER = _NoRecorder()
