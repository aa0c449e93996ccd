"""Sealed blocks: each metric series also stored as packed numpy arrays per range of steps.

Reading 250k rows through the driver costs ~1.5 s of Python tuples; reading the same points as
~250 blobs costs milliseconds. `metrics` stays the source of truth (unique keys, replays,
CSV); `series_blocks` is a derived copy of every block of BLOCK_STEPS steps that lies
wholly before the series' newest step. A series is read as its blocks plus the rows after
its last stored block. The single writer seals blocks as a series moves past them and
rebuilds a sealed block when a replay rewrites one of its steps; `seal_all` (at startup)
seals what was written without the writer: a database from schema 1, or rows inserted
directly.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .backend import Raw

BLOCK_STEPS = 1024
Key = tuple[int, str]  # (run_pk, metric name)
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # steps int64, values float64, times float64

_ROWS = "SELECT step, value, time FROM metrics WHERE run_pk=? AND name=? AND step>=? ORDER BY step"
_ROWS_UPTO = (
    "SELECT step, value, time FROM metrics WHERE run_pk=? AND name=? AND step>=? AND step<? "
    "ORDER BY step"
)
_BLOCKS = (
    "SELECT block, steps, vals, times FROM series_blocks WHERE run_pk=? AND name=? ORDER BY block"
)
_LAST_BLOCK = "SELECT MAX(block) FROM series_blocks WHERE run_pk=? AND name=?"


def rows_to_arrays(rows: list[tuple]) -> Arrays:
    """(step, value, time) rows to arrays; a NULL value (stored NaN) becomes NaN."""
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    steps = np.fromiter((r[0] for r in rows), np.int64, len(rows))  # exact up to 2**63-1
    a = np.array([r[1:] for r in rows], dtype=np.float64)
    return steps, a[:, 0].copy(), a[:, 1].copy()


def load(raw: Raw, run_pk: int, name: str) -> Arrays:
    """One whole series: its sealed blocks, then the rows after the last of them.

    Both reads run in one read transaction, so a batch sealed in between is not seen twice.
    """
    with raw.snapshot():
        blocks = raw.execute(_BLOCKS, (run_pk, name)).fetchall()
        start = (blocks[-1][0] + 1) * BLOCK_STEPS if blocks else 0
        tail = rows_to_arrays(raw.execute(_ROWS, (run_pk, name, start)).fetchall())
    if not blocks:
        return tail
    # read-only views of the blobs; concatenate makes the one owned copy
    parts = [
        (np.frombuffer(s, "<i8"), np.frombuffer(v, "<f8"), np.frombuffer(t, "<f8"))
        for _, s, v, t in blocks
    ]
    parts.append(tail)
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def seal(raw: Raw, run_pk: int, name: str, first: int, end: int) -> None:
    """(Re)build blocks first..end-1 of a series from its rows; empty blocks are not stored."""
    lo, hi = first * BLOCK_STEPS, end * BLOCK_STEPS
    steps, values, times = rows_to_arrays(
        raw.execute(_ROWS_UPTO, (run_pk, name, lo, hi)).fetchall()
    )
    raw.execute(
        "DELETE FROM series_blocks WHERE run_pk=? AND name=? AND block>=? AND block<?",
        (run_pk, name, first, end),
    )
    if not len(steps):
        return
    ids = steps // BLOCK_STEPS
    cuts = np.flatnonzero(np.diff(ids)) + 1
    bounds = zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(steps)]]))
    raw.executemany(
        "INSERT INTO series_blocks(run_pk, name, block, n, steps, vals, times) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        [
            (
                run_pk,
                name,
                int(ids[a]),
                int(b - a),
                steps[a:b].astype("<i8").tobytes(),
                values[a:b].astype("<f8").tobytes(),
                times[a:b].astype("<f8").tobytes(),
            )
            for a, b in bounds
        ],
    )


def sealed_upto(raw: Raw, run_pk: int, name: str) -> int:
    """One past the last stored block: blocks below it are sealed (or empty)."""
    last = raw.execute(_LAST_BLOCK, (run_pk, name)).fetchone()[0]
    return 0 if last is None else int(last) + 1


def seal_all(raw: Raw) -> int:
    """Seal every series up to the block of its newest step (from `latest`); returns how many
    blocks ranges were (re)built. Cheap when nothing is missing: one lookup per series."""
    built = 0
    for run_pk, name, step in raw.execute("SELECT run_pk, name, step FROM latest").fetchall():
        upto, target = sealed_upto(raw, run_pk, name), int(step) // BLOCK_STEPS
        if target > upto:
            seal(raw, run_pk, name, upto, target)
            built += 1
    return built


MAX_BOUNDS = 16_384  # series whose sealed bound is remembered (LRU); others cost a lookup
BOUND_BYTES = 400  # a (pk, name) key with a name of up to 200 characters, an int, the slot


@dataclass
class Sealer:
    """The writer's side: after each batch of metric rows, seal and rebuild what it needs.

    It remembers each series' sealed bound to save a lookup per batch, for the MAX_BOUNDS
    series written last only: a server's life sees millions of series."""

    _upto: OrderedDict[Key, int] = field(default_factory=OrderedDict)
    max_keys: int = MAX_BOUNDS

    def reset(self) -> None:
        """After a rollback, or a job (it may delete runs): forget every bound."""
        self._upto.clear()

    def __len__(self) -> int:
        return len(self._upto)

    @property
    def nbytes(self) -> int:
        return len(self._upto) * BOUND_BYTES

    def after_insert(self, raw: Raw, rows: list[tuple]) -> None:
        """rows: (run_pk, name, step, value, time) just upserted, inside the same transaction."""
        span: dict[Key, list[int]] = {}
        for r in rows:
            s = span.get((r[0], r[1]))
            if s is None:
                span[(r[0], r[1])] = [r[2], r[2]]
            elif r[2] < s[0]:
                s[0] = r[2]
            elif r[2] > s[1]:
                s[1] = r[2]
        for key, (lo, hi) in span.items():
            upto = self._upto.get(key)
            if upto is None:
                upto = sealed_upto(raw, *key)
            if lo // BLOCK_STEPS < upto:  # a replay rewrote sealed steps: rebuild those blocks
                dirty = sorted(
                    {
                        r[2] // BLOCK_STEPS
                        for r in rows
                        if (r[0], r[1]) == key and r[2] // BLOCK_STEPS < upto
                    }
                )
                for b in dirty:
                    seal(raw, key[0], key[1], b, b + 1)
            target = hi // BLOCK_STEPS
            if target > upto:
                seal(raw, key[0], key[1], upto, target)
                upto = target
            self._upto[key] = upto
            self._upto.move_to_end(key)
        while len(self._upto) > self.max_keys:
            self._upto.popitem(last=False)
