"""Events: what a person should look at, sent to the dashboard and printed as one line.

Rank 0 reports them (it holds the dashboard client). The trainer's own checks produce them:
non-finite loss and loss / gradient-norm spikes (fault/), stragglers (stragglers.py), a drop
of throughput (below), preemption, and a stall seen by the hang watchdog.
"""

from __future__ import annotations

import statistics
import sys
from collections import deque


class EventReporter:
    def __init__(self, rank: int, logger_of) -> None:
        """`logger_of()` gives rank 0's MetricsLogger (None elsewhere or after close)."""
        self.rank, self._logger_of = rank, logger_of
        self.sent: list[tuple[str, int | None]] = []  # (kind, step), for the run's summary

    def emit(
        self,
        kind: str,
        severity: str,
        message: str,
        step: int | None,
        details: dict | None = None,
        say: bool = True,
    ) -> None:
        """`say=False` when the check printed its own line already (fault/)."""
        if self.rank != 0:
            return
        if say:
            where = f"step {step}: " if step is not None else ""
            print(f"{severity}: {where}{kind}: {message}", file=sys.stderr, flush=True)
        self.sent.append((kind, step))
        logger = self._logger_of()
        if logger is not None:
            logger.event(kind, severity, message, step, details or {})


class ThroughputWatch:
    """tokens/s of a logged step below `fraction` of the median of the previous `window`
    logged steps: one drop per episode (reported again only after it recovered)."""

    MIN_HISTORY = 5

    def __init__(self, fraction: float, window: int = 20) -> None:
        self.fraction = fraction
        self._history: deque[float] = deque(maxlen=window)
        self._dropped = False

    def observe(self, tokens_per_sec: float) -> tuple[float, float] | None:
        """(tokens/s, median) when this step starts a drop, else None."""
        if not tokens_per_sec > 0:
            return None
        found = None
        if len(self._history) >= self.MIN_HISTORY:
            median = statistics.median(self._history)
            low = tokens_per_sec < self.fraction * median
            if low and not self._dropped:
                found = (tokens_per_sec, median)
            self._dropped = low
        if not self._dropped:  # a drop does not pull the median down
            self._history.append(tokens_per_sec)
        return found


def record_events(record: dict, reporter: EventReporter, throughput: ThroughputWatch) -> None:
    """The events of one logged record (rank 0): the non-finite outcome and spike z-scores
    that fault/session.py put in it (it printed their lines), and a throughput drop."""
    step = record["step"]
    action = record.get("nonfinite")
    if action:
        reporter.emit(
            "nonfinite_loss",
            "critical",
            f"non-finite lm_loss={record['lm_loss']} grad_norm={record['grad_norm']}: "
            + ("optimizer step skipped" if action == "skip" else "rolled back"),
            step,
            {
                "lm_loss": str(record["lm_loss"]),
                "grad_norm": str(record["grad_norm"]),
                "action": action,
            },
            say=False,
        )
    for key, kind, value in (
        ("loss_spike_z", "loss_spike", "lm_loss"),
        ("grad_norm_spike_z", "grad_norm_spike", "grad_norm"),
    ):
        z = record.get(key)
        if z is not None:
            reporter.emit(
                kind,
                "warning",
                f"{value}={record[value]:.6g} (robust z={z:.1f})",
                step,
                {value: record[value], "z": z},
                say=False,
            )
    rollback = record.get("spike_rollback")
    if rollback:  # fault/spike_recovery.py prints its own line when it rolls back
        reporter.emit(
            "spike_rollback",
            "critical",
            f"rolling back to the checkpoint of step {rollback['to_step']} (spike rollback "
            f"{rollback['number']}); data batches {rollback['first_skipped']}.."
            f"{rollback['last_skipped']} skipped",
            step,
            dict(rollback),
            say=False,
        )
    drop = throughput.observe(record.get("tokens_per_sec") or 0.0)
    if drop is not None:
        now, median = drop
        reporter.emit(
            "throughput_drop",
            "warning",
            f"tokens/s {now:.4g} is {now / median:.2f}x the median {median:.4g} of the last "
            "logged steps",
            step,
            {"tokens_per_sec": now, "median": median, "ratio": now / median},
        )
