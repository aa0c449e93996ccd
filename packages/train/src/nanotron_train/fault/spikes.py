"""Loss and gradient-norm spikes: a robust z-score of the step's value against the previous
`window` values.

z = (value - median) / (1.4826 * MAD): the median and the median absolute deviation ignore the
spikes themselves, unlike a mean and a standard deviation. Only finite values enter the window.

A z-score alone misfires on a healthy gradient norm: early in training it drifts and its MAD is
tiny, so a norm 1.6x the window's median scored z = 9 on the quickstart's own run. A value is
therefore a spike only when it is also at least `min_ratio` times the median: 1.0 (no extra
condition) for the loss, GRAD_NORM_MIN_RATIO for the gradient norm. Measured with
bench/dashboard_false_alarms.py (healthy runs of several seeds and layouts): the largest
healthy ratio to the median is printed there; the real spikes (a loss scaled 30x) are far
above it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

# a healthy run's gradient norm stays under this multiple of its recent median (see the bench)
GRAD_NORM_MIN_RATIO = 3.0


class LossSpikeDetector:
    MIN_HISTORY = 8

    def __init__(self, window: int, threshold: float, min_ratio: float = 1.0) -> None:
        self.window, self.threshold, self.min_ratio = window, threshold, min_ratio
        self._history: deque[float] = deque(maxlen=max(window, 1))

    def score(self, value: float) -> tuple[float, float] | None:
        """(robust z, value / median) against the current window; None before MIN_HISTORY."""
        if len(self._history) < self.MIN_HISTORY:
            return None
        median = statistics.median(self._history)
        mad = statistics.median(abs(x - median) for x in self._history)
        scale = 1.4826 * mad if mad > 0 else 1e-12 * max(abs(median), 1.0)
        ratio = value / median if median > 0 else math.inf
        return (value - median) / scale, ratio

    def observe(self, value: float) -> float | None:
        """The z-score when `value` is a spike, else None; then adds it to the window."""
        if self.window == 0 or not math.isfinite(value):
            return None
        z = None
        scored = self.score(value)
        if scored is not None and scored[0] > self.threshold and scored[1] >= self.min_ratio:
            z = scored[0]
        self._history.append(value)
        return z
