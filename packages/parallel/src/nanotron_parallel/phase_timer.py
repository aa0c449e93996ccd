"""Where the time of a training step goes, measured without waiting for the device.

A `PhaseTimer` adds up the milliseconds a rank spends in named phases (the whole step, the
pipeline's forwards and backwards, tp collectives, pp transfers, the dp reduction wait, the
optimizer, data). A span costs two clock reads:
  - host spans (and every span on the CPU): two `time.perf_counter()` calls;
  - device spans on a GPU: two CUDA events recorded on the current stream, taken from a pool
    that is reused interval after interval. `collect()` synchronizes once and reads them all:
    call it once per reporting interval, never per step.

The tensor-parallel collectives (tensor_parallel/functional.py, async_linear.py) and the
pipeline's p2p batches (pipeline/p2p.py) report their own spans through `comm_span`, to the
timer the trainer activates around each step it measures (`activate` / `deactivate`). With no
timer active `comm_span` returns a shared no-op context manager: one global read per
collective, nothing per tensor. The active timer is process-wide rather than thread-local
because on a GPU autograd runs the backward (and its collectives) on its own thread.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


NO_SPAN = _NoSpan()


class _HostSpan:
    __slots__ = ("phase", "t0", "timer")

    def __init__(self, timer: PhaseTimer, phase: str) -> None:
        self.timer, self.phase = timer, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> bool:
        self.timer.totals_ms[self.phase] += (time.perf_counter() - self.t0) * 1000.0
        return False


class _DeviceSpan:
    __slots__ = ("phase", "start", "timer")

    def __init__(self, timer: PhaseTimer, phase: str) -> None:
        self.timer, self.phase = timer, phase

    def __enter__(self) -> None:
        self.start = self.timer._event()
        self.start.record()

    def __exit__(self, *exc) -> bool:
        end = self.timer._event()
        end.record()
        self.timer._pending.append((self.phase, self.start, end))
        return False


class PhaseTimer:
    """Milliseconds per phase summed over the steps since the last `collect()`."""

    def __init__(self, device: torch.device) -> None:
        self.on_device = device.type == "cuda"
        self.device = device
        self.totals_ms: defaultdict[str, float] = defaultdict(float)
        self.steps = 0  # steps measured since the last collect
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._pool: list[torch.cuda.Event] = []

    def span(self, phase: str, host: bool = False) -> _HostSpan | _DeviceSpan:
        """A context manager timing `phase`; `host=True` measures host time even on a GPU (for
        host work such as reading the data)."""
        if self.on_device and not host:
            return _DeviceSpan(self, phase)
        return _HostSpan(self, phase)

    def _event(self) -> torch.cuda.Event:
        return self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)

    def collect(self) -> tuple[dict[str, float], int]:
        """(total ms per phase, steps) since the last call, then start afresh. On a GPU this
        synchronizes the device once and reads every pending event pair."""
        if self._pending:
            torch.cuda.synchronize(self.device)
            for phase, start, end in self._pending:
                self.totals_ms[phase] += start.elapsed_time(end)
                self._pool += (start, end)
            self._pending.clear()
        totals, steps = dict(self.totals_ms), self.steps
        self.totals_ms.clear()
        self.steps = 0
        return totals, steps


_active: PhaseTimer | None = None


def activate(timer: PhaseTimer | None) -> None:
    """Make `timer` receive the communication spans (None: none is measured)."""
    global _active
    _active = timer


def deactivate() -> None:
    activate(None)


def comm_span(phase: str) -> _NoSpan | _HostSpan | _DeviceSpan:
    """The span of one communication call for the active timer, or a no-op."""
    timer = _active
    return NO_SPAN if timer is None else timer.span(phase)
