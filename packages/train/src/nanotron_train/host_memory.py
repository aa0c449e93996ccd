"""Host memory a step frees is kept for the next step (glibc's malloc, set once per process).

A training step allocates and frees the same large host tensors every step: on a CPU every
activation, gradient and temporary, on a GPU the host-side staging. glibc serves each block
above its mmap threshold (adaptive, at most 32 MiB) with a fresh mapping, and hands the free
memory at the top of its heap back to the kernel once it exceeds the trim threshold; either
way, the next step touches new pages and takes a page fault per 4 KiB (about 20,000 per step
on the CPU benchmark's model, 6% of its step time). Two fixed thresholds, set when the trainer
starts, serve blocks up to 256 MiB from the heap and keep up to 1 GiB of freed heap for reuse:
the process then holds its per-step peak instead of returning it and faulting it back in,
bounded by those figures. jemalloc or tcmalloc, preloaded, do the same job; this needs neither.
Other C libraries (musl, macOS) are left as they are.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # blocks up to this come from the heap
TRIM_THRESHOLD = 1 << 30  # free heap kept before any is returned to the kernel


def keep_freed_host_memory() -> bool:
    """Set glibc's thresholds for this process; whether they were set (False: not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False  # not glibc: its mallopt parameters may mean something else
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(done and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
