"""Loss spikes: a robust z-score of the step's loss against the previous `window` losses.

z = (loss - median) / (1.4826 * MAD): the median and the median absolute deviation ignore the
spikes themselves, unlike a mean and a standard deviation. Only finite losses enter the window.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class LossSpikeDetector:
    MIN_HISTORY = 8

    def __init__(self, window: int, threshold: float) -> None:
        self.window, self.threshold = window, threshold
        self._history: deque[float] = deque(maxlen=max(window, 1))

    def observe(self, loss: float) -> float | None:
        """The z-score when `loss` is a spike, else None; then adds it to the window."""
        if self.window == 0 or not math.isfinite(loss):
            return None
        z = None
        if len(self._history) >= self.MIN_HISTORY:
            median = statistics.median(self._history)
            mad = statistics.median(abs(x - median) for x in self._history)
            scale = 1.4826 * mad if mad > 0 else 1e-12 * max(abs(median), 1.0)
            score = (loss - median) / scale
            if score > self.threshold:
                z = score
        self._history.append(loss)
        return z
