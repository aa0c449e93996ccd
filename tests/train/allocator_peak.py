"""The peak of the bytes live in torch's CPU allocator over a block: the measure the memory
model (nanotron_train/plan/memory.py) is compared with, exact and the same from run to run.

Why not the peak RSS (VmHWM) the memory tests read before: the trainer keeps the host memory a
step frees (nanotron_train/host_memory.py: every block up to 256 MiB from glibc's heap, up to
1 GiB of freed heap kept), so the RSS peak is the heap's high-water mark, and where glibc
places each block depends on the heap's history (the layouts run before in the process, the
fork server's own allocations, dict orders under hash randomisation). The same run in the same
process measured 261 and 284 MiB of RSS growth over a live peak of 180.11 MiB both times; with
the heap not kept (a fixed 64 KiB mmap threshold) the RSS growth is that live peak + 1-4 MiB.
A process's first run adds ~80 MiB more (lazy imports, code pages). The allocator's own count
moves with none of these: the profiler's memory events (c10's ProfiledCPUMemoryReporter)
record every tensor allocated and freed while it records, and the peak of their running sum
is the most tensor bytes live at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.profiler import ProfilerActivity, profile


def _allocations(prof) -> list[tuple[int, int, int]]:
    """(time, address, size; negative: a free) of every allocation and free recorded."""
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        f = e.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation":
            out.append((e.start_time_ns, f.ptr, f.alloc_size))
        stack.extend(e.children)
    return sorted(out)


def peak_of(events: list[tuple[int, int, int]]) -> int:
    """The most bytes live at once among the blocks allocated in `events`: a free of a block
    allocated before (an earlier layout's, freed when the garbage collector ran) is not this
    block's and is left out."""
    live = peak = 0
    sizes: dict[int, int] = {}
    for _, ptr, size in events:
        if size > 0:
            # an address handed out again was freed, whatever the order the events' clocks
            # give (a free recorded after the next allocation there counted it twice)
            live += size - sizes.get(ptr, 0)
            sizes[ptr] = size
            peak = max(peak, live)
        elif ptr in sizes:
            live -= sizes.pop(ptr)
    return peak


@contextlib.contextmanager
def allocator_peak() -> Iterator[dict]:
    """`with allocator_peak() as got:` ... then got["bytes"]: the most bytes live in torch's CPU
    allocator at once beyond those live when the block began."""
    got: dict = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield got
    got["bytes"] = peak_of(_allocations(prof))
