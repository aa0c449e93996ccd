"""The server's memory account: everything that grows with runs, metrics or requests, in bytes.

Each part has a fixed cap; the caps plus the idle process (interpreter, libraries, SQLite's
page caches) fit MEMORY_BUDGET_BYTES, for the whole life of the server: what is keyed by a
run or a metric is evicted by the caps and dropped when the run is deleted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

from .blocks import BOUND_BYTES, MAX_BOUNDS
from .checkpoints import METADATA
from .writer_index import MAX_NAMES, MAX_RUNS, NAME_BYTES, RUN_ENTRY_BYTES

MEMORY_BUDGET_BYTES = 384 << 20  # peak RSS, measured by bench/dashboard_load.py and _soak.py
# the idle server (~80 MiB measured) plus parsing and responses in flight
BASELINE_BYTES = 96 << 20
WRITER_INDEX_MAX = MAX_RUNS * RUN_ENTRY_BYTES + MAX_NAMES * NAME_BYTES + MAX_BOUNDS * BOUND_BYTES


def limits(cache_bytes: int, queue_bytes: int) -> dict[str, int]:
    return {
        "series_cache": cache_bytes,
        "writer_queue": queue_bytes,
        "writer_index": WRITER_INDEX_MAX,
        "checkpoint_metadata": METADATA.max_bytes,
    }


def fits(cache_bytes: int, queue_bytes: int) -> bool:
    return BASELINE_BYTES + sum(limits(cache_bytes, queue_bytes).values()) <= MEMORY_BUDGET_BYTES


M_ARENA_MAX = -8  # glibc's mallopt parameter
MALLOC_ARENAS = 2


def limit_malloc_arenas() -> None:
    """Two malloc arenas for the whole process. glibc gives each thread that allocates at
    once an arena of its own (up to 8 per core) and keeps what is freed in it: the route
    thread pool's 40 threads, each having built a heatmap once, would hold on to many peaks
    (measured: six heatmap readers at once, 294 MiB peak RSS on PostgreSQL; 174 MiB with two
    arenas). Not glibc: nothing to do."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_ARENA_MAX, MALLOC_ARENAS)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def account(state: Any) -> dict[str, Any]:
    """What each part holds now, its cap, and what the writer remembers (counts)."""
    held = state.writer.held()
    s = state.settings
    return {
        "bytes": {
            "series_cache": state.cache.nbytes,
            "writer_queue": state.writer.queued_bytes,
            "writer_index": held["bytes"],
            "checkpoint_metadata": METADATA.nbytes,
        },
        "limits": limits(s.cache_bytes, s.queue_bytes),
        "held": {
            "series": len(state.cache),
            "runs": held["runs"],
            "names": held["names"],
            "series_bounds": held["series_bounds"],
            "checkpoint_metadata": len(METADATA),
            "live_feeds": state.hub.feeds(),
        },
        "budget_bytes": MEMORY_BUDGET_BYTES,
        "rss_bytes": rss_bytes(),
    }
