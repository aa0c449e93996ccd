"""Stragglers: a rank whose non-waiting time stays above the median of its peers.

In synchronous training every rank's step takes the same wall time (the others wait for the
slow one), so step time cannot single a rank out. What differs is the time a rank spends
working rather than waiting: compute + optimizer + data. A rank is slow in an interval when
that time exceeds the median of its peers (the others: with itself among them, a stage of two
ranks could never show a ratio of 2, the median being their mean) by more than `margin` (a
fraction); after
`intervals` slow intervals in a row it is reported once, and again only after it has recovered.

Peers are the ranks of the same pipeline stage (its dp, tp and cp ranks do the same work):
stages differ in work by design (the last one has the lm_head and the loss), so comparing
across stages would name a well-partitioned stage. A stage of one rank (dp = tp = cp = 1) is
compared with the median of all other ranks.
"""

from __future__ import annotations

import statistics


def busy_ms(entry: dict) -> float:
    return sum(entry.get(k) or 0.0 for k in ("compute_ms", "optimizer_ms", "data_ms"))


class StragglerDetector:
    def __init__(self, margin: float, intervals: int) -> None:
        self.margin, self.intervals = margin, intervals
        self._slow: dict[int, int] = {}  # rank -> slow intervals in a row

    def observe(self, ranks: list[dict]) -> list[tuple[dict, float]]:
        """The (entry, busy / median) of each rank that has just become a straggler."""
        if len(ranks) < 2:
            return []
        stages: dict[int, list[dict]] = {}
        for e in ranks:
            stages.setdefault(e.get("pp", 0), []).append(e)
        found = []
        for e in ranks:
            stage = stages[e.get("pp", 0)]
            peers = [busy_ms(o) for o in (stage if len(stage) > 1 else ranks) if o is not e]
            median = statistics.median(peers)
            ratio = busy_ms(e) / median if median > 0 else 1.0
            if ratio > 1.0 + self.margin:
                self._slow[e["rank"]] = self._slow.get(e["rank"], 0) + 1
                if self._slow[e["rank"]] == self.intervals:
                    found.append((e, ratio))
            else:
                self._slow[e["rank"]] = 0
        return found
