"""Metric series in memory (numpy), min/max-preserving downsampling and EMA smoothing.

The metrics API reads whole series from this cache, so a 1M-point database answers in
milliseconds once warm. The single writer appends new points after each commit; an
out-of-order write (a replay) drops the cached series, which reloads from SQLite on demand.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Key = tuple[int, str]  # (run_pk, metric name)
# bytes an entry costs besides its arrays: key and name (up to 200 characters), the Series and
# array objects, the dict slot, malloc slack (tracemalloc: ~650 with a 20-character name)
ENTRY_OVERHEAD = 1024


@dataclass
class Series:
    steps: np.ndarray  # int64, ascending
    values: np.ndarray  # float64, NaN where the value was NaN
    times: np.ndarray  # float64, unix seconds
    n: int

    @property
    def nbytes(self) -> int:
        return self.steps.nbytes + self.values.nbytes + self.times.nbytes + ENTRY_OVERHEAD

    def view(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.steps[: self.n], self.values[: self.n], self.times[: self.n]

    def append(self, steps: list[int], values: list[float], times: list[float]) -> None:
        m = len(steps)
        if self.n + m > len(self.steps):  # grow by doubling; old views stay valid
            cap = max(2 * len(self.steps), self.n + m, 1024)
            for name in ("steps", "values", "times"):
                old = getattr(self, name)
                new = np.empty(cap, dtype=old.dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        self.steps[self.n : self.n + m] = steps
        self.values[self.n : self.n + m] = values
        self.times[self.n : self.n + m] = times
        self.n += m


Loader = Callable[[int, str], tuple[np.ndarray, np.ndarray, np.ndarray]]


class SeriesCache:
    """LRU cache of whole series, bounded by the bytes it holds (an empty series costs its
    overhead too, so asking for many unknown names cannot grow it without bound)."""

    def __init__(self, loader: Loader, max_bytes: int = 256 << 20) -> None:
        self._loader = loader
        self.max_bytes = max_bytes
        self._items: OrderedDict[Key, Series] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, run_pk: int, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (run_pk, name)
        with self._lock:  # loading under the lock: the writer cannot slip a batch in between
            s = self._items.get(key)
            if s is None:
                steps, values, times = self._loader(run_pk, name)
                s = Series(steps, values, times, len(steps))
                self._items[key] = s
                self._total += s.nbytes
                self._evict()
            self._items.move_to_end(key)
            return s.view()

    def on_commit(self, points: dict[Key, tuple[list[int], list[float], list[float]]]) -> None:
        """Called by the writer after a commit with the points it wrote, in step order."""
        with self._lock:
            for key, (steps, values, times) in points.items():
                s = self._items.get(key)
                if s is None:
                    continue
                if s.n and steps[0] <= s.steps[s.n - 1]:
                    self._total -= s.nbytes
                    del self._items[key]  # overwrite of old steps: reload on demand
                    continue
                before = s.nbytes
                s.append(steps, values, times)
                self._total += s.nbytes - before
            self._evict()

    def run_pks(self) -> set[int]:
        with self._lock:
            return {k[0] for k in self._items}

    def drop_run(self, run_pk: int) -> None:
        with self._lock:
            for key in [k for k in self._items if k[0] == run_pk]:
                self._total -= self._items.pop(key).nbytes

    def _evict(self) -> None:
        while self._total > self.max_bytes and len(self._items) > 1:
            _, s = self._items.popitem(last=False)
            self._total -= s.nbytes

    @property
    def nbytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._items)


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's smoothing) over the full series.

    Non-finite values are skipped (the previous finite value is carried forward).
    """
    n = len(values)
    if n == 0 or weight <= 0:
        return values.astype(np.float64, copy=True)
    a = float(weight)
    x = values.astype(np.float64, copy=True)
    finite = np.isfinite(x)
    if not finite.any():
        return np.full(n, np.nan)
    idx = np.where(finite, np.arange(n), 0)  # forward-fill (leading ones: the first finite)
    np.maximum.accumulate(idx, out=idx)
    first = int(np.argmax(finite))
    idx[:first] = first
    s = linear_recurrence((1 - a) * x[idx], a)
    return s / (1 - a ** (np.arange(n) + 1))


def linear_recurrence(b: np.ndarray, w: float, chunk: int = 128) -> np.ndarray:
    """y[t] = b[t] + w * y[t-1] (y[-1] = 0) without a Python loop over t.

    Inside chunks it is a lower-triangular matrix product; the chunks' end values obey the
    same recurrence with weight w**chunk, solved recursively, then carried into each chunk.
    """
    n = len(b)
    i = np.arange(min(n, chunk))
    diff = i[:, None] - i[None, :]
    mat = np.where(diff >= 0, w ** np.maximum(diff, 0), 0.0)
    if n <= chunk:
        return mat @ b
    pad = (-n) % chunk
    cols = np.concatenate([b, np.zeros(pad)]).reshape(-1, chunk).T  # [chunk, nchunks]
    inner = mat @ cols  # each chunk started from 0
    ends = linear_recurrence(inner[-1], w**chunk, chunk)  # true end value of each chunk
    prev = np.concatenate([[0.0], ends[:-1]])
    out = inner + (w ** (i + 1))[:, None] * prev[None, :]
    return out.T.reshape(-1)[:n]


def downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of the points to draw: per bucket its first, last, min and max point.

    Buckets are equal runs of consecutive points; non-finite y are ignored for min/max.
    """
    n = len(x)
    if n <= max_points:
        return np.arange(n)
    buckets = max(1, max_points // 4)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    starts = edges[:-1]
    starts = starts[np.diff(edges) > 0]
    ends = np.append(starts[1:], n) - 1
    yf = np.where(np.isfinite(y), y, np.nan)
    lo = np.fmin.reduceat(yf, starts)
    hi = np.fmax.reduceat(yf, starts)
    bucket_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
    pick = [starts, ends]
    for target in (lo, hi):
        hit = np.flatnonzero(yf == target[bucket_of])
        _, first_hit = np.unique(bucket_of[hit], return_index=True)
        pick.append(hit[first_hit])
    return np.unique(np.concatenate(pick))
