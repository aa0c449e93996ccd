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

One interval's ratio misleads on a shared machine: with 4 workers and other jobs on 2 cores,
an undisturbed rank's ratio to its peer had a log sigma of 0.25-0.45 per interval and came in
bursts (1.6-2x for several intervals when another process shared its core; bench/
straggler_false_alarms.py). So each rank's log-ratio is taken over its baseline (its usual
place, from its ordinary intervals: e.g. a rank that always shares a core), and what must pass
the bar is the trimmed mean of its last `intervals` of those (the window less its highest and
lowest: one hiccup cannot move it, a rank slow in most of the window does). The bar is the
margin, or NOISE_SIGMAS spreads of that mean when the noise is wider: the robust sigma of the
stage's histories, weighed with a prior of a shared machine's (so the calm start of a run does
not set the bar low before the machine's first burst). A rank is named when its window is above
for RAISE_AFTER intervals in a row and its latest interval too, or, whatever the noise (a
slowdown's first intervals widen it), when its window has stayed above the margin for LASTING
intervals: the machine's bursts were shorter. Once per episode: it can be named again after its
window fell below half the bar. On a GPU cluster the noise is far below the margin, which
decides.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

HISTORY = 30  # intervals of each rank's baseline and noise
MIN_HISTORY = 8  # intervals before a rank's own baseline is used
NOISE_SIGMAS = 3.5  # the bar, in spreads of the window's trimmed mean
PRIOR_SIGMA, PRIOR_INTERVALS = 0.3, 10  # a shared machine's log sigma (measured 0.25-0.45)
RAISE_AFTER = 2  # intervals in a row with the window above the bar
LASTING = 10  # intervals in a row with the window above the margin: slow whatever the noise


def busy_ms(entry: dict) -> float:
    return sum(entry.get(k) or 0.0 for k in ("compute_ms", "optimizer_ms", "data_ms"))


def _trimmed_mean(xs: deque[float]) -> float:
    """The mean without the highest and the lowest value (the median under 4 values): one
    hiccup either way cannot move it, and it wastes less of the window than a median."""
    if len(xs) < 4:
        return statistics.median(xs)
    kept = sorted(xs)[1:-1]
    return sum(kept) / len(kept)


def _median_without(sorted_xs: list[float], i: int) -> float:
    """The median of `sorted_xs` less its element `i`, in O(1) (n >= 2)."""
    n = len(sorted_xs) - 1

    def at(j: int) -> float:  # element j of the list without element i
        return sorted_xs[j if j < i else j + 1]

    return at(n // 2) if n % 2 else 0.5 * (at(n // 2 - 1) + at(n // 2))


class _Rank:
    """One rank's state: its baseline history, its window of excesses, its episode."""

    def __init__(self, window: int) -> None:
        self.history: deque[float] = deque(maxlen=HISTORY)
        self.window: deque[float] = deque(maxlen=window)
        self.named = False
        self.above = 0  # consecutive intervals with the window above the bar
        self.over = 0  # consecutive intervals with the window above the margin


class StragglerDetector:
    def __init__(self, margin: float, intervals: int) -> None:
        self.margin, self.intervals = margin, intervals
        self._ranks: dict[int, _Rank] = {}

    def ratios(self, ranks: list[dict]) -> dict[int, float]:
        """Each rank's busy time over the median of its peers' (1.0 when that is 0): one sort
        per stage, O(ranks log ranks)."""
        out = {}
        for members, group in self._stages(ranks):
            order = sorted(group, key=busy_ms)
            values = [busy_ms(e) for e in order]
            where = {id(e): i for i, e in enumerate(order)}
            for e in members:
                median = _median_without(values, where[id(e)])
                out[e["rank"]] = busy_ms(e) / median if median > 0 else 1.0
        return out

    def baseline(self, rank: int) -> float:
        """The rank's usual log-ratio, from 0 to half the margin's: a rank that has drifted
        slow, interval after interval, must not make that its normal; one usually faster than
        its peers is held to the margin like the others (named, a rank is always more than
        1 + margin times its peers)."""
        h = self._ranks[rank].history
        if len(h) < MIN_HISTORY:
            return 0.0
        return min(max(statistics.median(h), 0.0), 0.5 * math.log1p(self.margin))

    def noise(self, ranks: list[dict]) -> dict[int, float]:
        """Each rank's sigma of its log-ratio: the robust spread of its stage's histories (all
        ranks' for a stage of one), each about its own median (a stage's ranks share its
        noise; a stage next to a slowed one can be noisier than the rest), weighed with a
        prior of a shared machine's noise (PRIOR_SIGMA, as PRIOR_INTERVALS intervals): a run
        whose first intervals were calm has not yet seen the machine's bursts."""
        centred = {}  # rank -> its history about its median
        for e in ranks:
            h = self._ranks[e["rank"]].history
            m = statistics.median(h) if h else 0.0
            centred[e["rank"]] = [abs(x - m) for x in h]
        out, done = {}, {}  # done: the stages of one share the group of all ranks
        for members, group in self._stages(ranks):
            if id(group) not in done:
                devs = [d for e in group for d in centred[e["rank"]]]
                n = len(devs) / len(group)  # intervals of history per rank
                seen = (1.4826 * statistics.median(devs)) ** 2 if devs else 0.0
                prior = PRIOR_INTERVALS * PRIOR_SIGMA**2
                done[id(group)] = math.sqrt((n * seen + prior) / (n + PRIOR_INTERVALS))
            out.update({e["rank"]: done[id(group)] for e in members})
        return out

    @staticmethod
    def _stages(ranks: list[dict]) -> list[tuple[list[dict], list[dict]]]:
        """Per stage: (its ranks, the ranks whose busy times and noise they are compared
        with: the stage's, or all ranks for a stage of one)."""
        stages: dict[int, list[dict]] = {}
        for e in ranks:
            stages.setdefault(e.get("pp", 0), []).append(e)
        return [(g, g if len(g) > 1 else ranks) for g in stages.values()]

    def bar(self, sigma: float) -> float:
        """What the window's trimmed mean must pass: the margin, or NOISE_SIGMAS spreads of it
        under this noise when that is wider. Its spread is taken as that of a mean of half as
        many independent intervals: the machine's noise comes in bursts (a process sharing a
        rank's core for a few seconds), so neighbouring intervals are alike."""
        spread = sigma / math.sqrt(max(1.0, 0.5 * self.intervals))
        return max(math.log1p(self.margin), NOISE_SIGMAS * spread)

    def observe(self, ranks: list[dict]) -> list[tuple[dict, float]]:
        """The (entry, busy / median) of each rank that has just become a straggler."""
        if len(ranks) < 2:
            return []
        ratio = self.ratios(ranks)
        for e in ranks:
            self._ranks.setdefault(e["rank"], _Rank(self.intervals))
        noise, ordinary = self.noise(ranks), math.log1p(self.margin)
        found = []
        for e in ranks:
            r, state = e["rank"], self._ranks[e["rank"]]
            x = math.log(max(ratio[r], 1e-9))
            excess = x - self.baseline(r)
            state.window.append(excess)
            windowed = _trimmed_mean(state.window)
            bar = self.bar(noise[r])
            full = len(state.window) == self.intervals
            state.above = state.above + 1 if full and windowed > bar else 0
            state.over = state.over + 1 if full and windowed > ordinary else 0
            # the window says so (RAISE_AFTER times in a row), and this interval too
            lasting = state.above >= RAISE_AFTER or state.over >= LASTING
            if lasting and excess > ordinary and not state.named:
                state.named = True
                found.append((e, ratio[r]))
            elif state.named and windowed < 0.5 * bar:
                state.named = False  # the episode is over
            # the baseline and noise learn from ordinary windows only, one hiccup in them
            # being noise (and kept as such): not a slow rank's, nor a slow rank's fast peer's.
            # By the margin, not the bar: a bar widened by a slowdown's first intervals would
            # let in more of them, and the slowdown would become the rank's normal
            if not state.named and abs(windowed) < ordinary:
                state.history.append(x)
        return found
