"""What the writer remembers between batches, bounded: run ids' keys and metric names.

Looking a run's pk up or loading its metric names costs a query, so the writer keeps the ones
in use; a server that sees millions of runs over its life must not keep them all. Both maps
are LRU with fixed caps (far above what one batch touches: a batch holds at most 5,000
messages), cleared after every job (a job may delete runs) and after a rollback.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_RUNS = 8192  # run id -> pk entries (> a batch's 5,000 messages: a batch keeps its own)
MAX_NAMES = 32_768  # metric names held, over all runs
RUN_ENTRY_BYTES = 400  # an id of up to 200 characters, an int, the dict slot
NAME_BYTES = 300  # a name of up to 200 characters and its set slot


class RunIndex:
    def __init__(self, max_runs: int = MAX_RUNS, max_names: int = MAX_NAMES) -> None:
        self.max_runs = max_runs
        self.max_names = max_names
        self._pks: OrderedDict[str, int] = OrderedDict()
        self._names: OrderedDict[int, set[str]] = OrderedDict()
        self._n_names = 0

    def pk(self, run_id: str) -> int | None:
        pk = self._pks.get(run_id)
        if pk is not None:
            self._pks.move_to_end(run_id)
        return pk

    def set_pk(self, run_id: str, pk: int) -> None:
        self._pks[run_id] = pk
        while len(self._pks) > self.max_runs:
            self._pks.popitem(last=False)

    def run_ids(self) -> dict[int, str]:
        return {pk: rid for rid, pk in self._pks.items()}

    def names(self, pk: int) -> set[str] | None:
        names = self._names.get(pk)
        if names is not None:
            self._names.move_to_end(pk)
        return names

    def set_names(self, pk: int, names: set[str]) -> None:
        old = self._names.pop(pk, None)
        self._n_names -= len(old) if old else 0
        self._names[pk] = names
        self._n_names += len(names)
        self._evict_names()

    def add_names(self, pk: int, new: list[str]) -> None:
        names = self._names[pk]
        before = len(names)
        names.update(new)
        self._n_names += len(names) - before
        self._evict_names()

    def _evict_names(self) -> None:
        while self._n_names > self.max_names and len(self._names) > 1:
            _, names = self._names.popitem(last=False)
            self._n_names -= len(names)

    def clear(self) -> None:
        self._pks.clear()
        self._names.clear()
        self._n_names = 0

    def sizes(self) -> tuple[int, int]:
        """(runs, names) held."""
        return len(self._pks), self._n_names

    @property
    def nbytes(self) -> int:
        return len(self._pks) * RUN_ENTRY_BYTES + self._n_names * NAME_BYTES
