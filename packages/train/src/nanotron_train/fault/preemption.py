"""Preemption: on SIGTERM or SIGUSR1 every rank finishes the step, saves, and exits 0.

The signal handler only sets a flag. At the end of each step `stop_now(step)` answers the same
on every rank, even when only one rank got the signal: that rank proposes "stop after the next
step" in the shared store (compare-and-set: the first proposal wins), and every rank checks the
store once per step. The proposal is posted before the proposer enters the next step's
gradient-norm all-reduce, which spans the whole world, so no rank can finish that next step
without the key being there to read: all ranks stop after the same step. One store lookup per
step (a small TCP round trip to the launcher, no device synchronisation), except after the
last step: a stop then changes nothing, and the store's host may already have left.
"""

from __future__ import annotations

import signal
import sys
import threading

from nanotron_train.fault.coordination import try_get
from nanotron_train.fault.errors import TrainingStopped

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_KEY = "stop_after_step"


class Preemption:
    def __init__(self, rank: int, store=None) -> None:
        self.rank, self.store = rank, store
        self.signal_name: str | None = None
        self._stop_after: int | None = None
        self._proposed = False
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # handlers only live there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            print(
                f"rank {self.rank}: {self.signal_name} received: finishing the step, saving a "
                "checkpoint and exiting",
                file=sys.stderr,
                flush=True,
            )

    @property
    def requested(self) -> bool:
        return self._stop_after is not None or self.signal_name is not None

    def stop_now(self, step: int) -> bool:
        """True on every rank after the same step once any rank was signalled. Call once per
        step on every rank, after the step's collectives."""
        if self.store is None:  # one process: the flag is the decision
            return self.signal_name is not None
        try:
            if self.signal_name is not None and not self._proposed:
                self._proposed = True
                agreed = self.store.compare_set(STOP_KEY, "", str(step + 1))
                self._stop_after = int(agreed)
            if self._stop_after is None:
                raw = try_get(self.store, STOP_KEY)
                if raw:
                    self._stop_after = int(raw)
        except (RuntimeError, OSError) as exc:  # DistNetworkError & co: the store is gone
            raise TrainingStopped(
                f"rank {self.rank}: the launcher's store does not answer ({type(exc).__name__}): "
                "torchrun died or is unreachable"
            ) from None
        return self._stop_after is not None and step >= self._stop_after

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
