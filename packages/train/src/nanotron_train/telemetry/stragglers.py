"""Stragglers: a rank whose non-waiting time stays above its peers' by more than the noise.

In synchronous training every rank's step takes the same wall time (the others wait for the
slow one), so step time cannot single a rank out. What differs is the time a rank spends
working rather than waiting: compute + optimizer + data. Each interval, a rank's ratio is that
time over the median of its peers (the others: with itself among them, a stage of two ranks
could never show a ratio of 2, the median being their mean).

Peers are the ranks of the same pipeline stage (its dp, tp and cp ranks do the same work):
stages differ in work by design (the last one has the lm_head and the loss), so comparing
across stages would name a well-partitioned stage. A stage of one rank (dp = tp = cp = 1) is
compared with the median of all other ranks.

A ratio alone misfires on a shared machine: four processes on two cores take turns, and an
undisturbed rank's ratio reached 1.5-2.1x for an interval or two. So the ratio is read against
a noise model: each rank's own history of log-ratios (intervals it was not slow in: its usual
place, e.g. a rank that always shares a core) and the spread of those histories over all ranks
(a robust sigma, pooled). A rank is slow in an interval when its log-ratio exceeds its own
baseline by more than log(1 + margin) and by more than NOISE_SIGMAS sigmas. Its count goes up
one per slow interval and down two per normal one (a peer's hiccup amid a straggler's episode
does not restart it); at `intervals` it is reported once, and again only after the count went
back to 0.
bench/dashboard_false_alarms.py measures both sides (undisturbed runs, a rank slowed 2x).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

HISTORY = 30  # intervals of each rank's baseline
MIN_HISTORY = 4  # intervals before a rank's own baseline and the pooled sigma are used
NOISE_SIGMAS = 2.5


def busy_ms(entry: dict) -> float:
    return sum(entry.get(k) or 0.0 for k in ("compute_ms", "optimizer_ms", "data_ms"))


def _mad_sigma(xs: list[float]) -> float:
    m = statistics.median(xs)
    return 1.4826 * statistics.median(abs(x - m) for x in xs)


class StragglerDetector:
    def __init__(self, margin: float, intervals: int) -> None:
        self.margin, self.intervals = margin, intervals
        self._slow: dict[int, int] = {}  # rank -> slow intervals (less two per normal one)
        self._reported: set[int] = set()  # ranks named in their current episode
        self._history: dict[int, deque[float]] = {}  # rank -> log-ratios of normal intervals

    def ratios(self, ranks: list[dict]) -> dict[int, float]:
        """Each rank's busy time over the median of its peers' (1.0 when that is 0)."""
        stages: dict[int, list[dict]] = {}
        for e in ranks:
            stages.setdefault(e.get("pp", 0), []).append(e)
        out = {}
        for e in ranks:
            stage = stages[e.get("pp", 0)]
            peers = [busy_ms(o) for o in (stage if len(stage) > 1 else ranks) if o is not e]
            median = statistics.median(peers)
            out[e["rank"]] = busy_ms(e) / median if median > 0 else 1.0
        return out

    def sigma(self) -> float:
        """The pooled noise: the median over ranks of each one's robust spread of log-ratio."""
        spreads = [_mad_sigma(list(h)) for h in self._history.values() if len(h) >= MIN_HISTORY]
        return statistics.median(spreads) if spreads else 0.0

    def baseline(self, rank: int) -> float:
        """The rank's usual log-ratio, at most half the margin's: a rank that has drifted
        slow, interval after interval, must not make that its normal."""
        h = self._history.get(rank)
        if h is None or len(h) < MIN_HISTORY:
            return 0.0
        return min(statistics.median(h), 0.5 * math.log1p(self.margin))

    def observe(self, ranks: list[dict]) -> list[tuple[dict, float]]:
        """The (entry, busy / median) of each rank that has just become a straggler."""
        if len(ranks) < 2:
            return []
        ratio = self.ratios(ranks)
        bar = max(math.log1p(self.margin), NOISE_SIGMAS * self.sigma())
        found = []
        for e in ranks:
            r = e["rank"]
            x = math.log(max(ratio[r], 1e-9))
            if x > 0 and x - self.baseline(r) > bar:
                self._slow[r] = self._slow.get(r, 0) + 1
                if self._slow[r] >= self.intervals and r not in self._reported:
                    self._reported.add(r)
                    found.append((e, ratio[r]))
                continue
            # one normal interval takes back two slow ones: a peer's own hiccup in the
            # middle of a straggler's episode does not start its count again
            self._slow[r] = max(0, self._slow.get(r, 0) - 2)
            if self._slow[r] == 0:
                self._reported.discard(r)
            if x - self.baseline(r) > -bar:  # not the fast peer of a slow rank either
                self._history.setdefault(r, deque(maxlen=HISTORY)).append(x)
        return found
