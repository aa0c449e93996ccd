"""Rank clocks aligned at the timeline's barrier: each rank's offset from rank 0, with bounds.

Every rank times its pipeline spans from its own origin, taken when it leaves the barrier; the
ranks leave it at different moments (milliseconds apart on a loaded machine), and on several
hosts their clocks differ outright. So the barrier is made of ROUNDS all-gathers, each timed on
every rank: the window [a, b] around a round, in the rank's own clock. Rank 0 entered round k
(its a) before rank r left it (r's b), and r entered before 0 left, so rank r's clock minus
rank 0's, theta, lies in (a_r - b_0, b_r - a_0) for every round. The intersection gives the
estimate (its middle) and the uncertainty (half its width). The windows of a round travel in
the next round's all-gather: ROUNDS + 1 collectives, on recorded steps only.
"""

from __future__ import annotations

import math
import time

import torch.distributed as dist

ROUNDS = 4


def offset_bounds(
    windows: list[tuple[float, float]], mine: list[tuple[float, float]]
) -> tuple[float, float]:
    """(low, high) of theta = this clock - rank 0's, from rank 0's and this rank's windows."""
    lo, hi = -math.inf, math.inf
    for (a0, b0), (a, b) in zip(windows, mine):
        lo, hi = max(lo, a - b0), min(hi, b - a0)
    return lo, hi


def align(group, world_size: int) -> tuple[float, float]:
    """Collective (every rank of `group`): (theta, uncertainty) in seconds of perf_counter;
    rank 0's is (0, 0). Also a barrier: it returns after every rank entered the last round."""
    mine: list[tuple[float, float]] = []
    rank0: list[tuple[float, float]] = []
    last = None
    for _ in range(ROUNDS + 1):
        a = time.perf_counter()
        got: list = [None] * world_size
        dist.all_gather_object(got, last, group=group)
        b = time.perf_counter()
        if got[0] is not None:  # the previous round's window of rank 0
            rank0.append(got[0])
        last = (a, b)
        if len(mine) < ROUNDS:
            mine.append((a, b))
    lo, hi = offset_bounds(rank0, mine[: len(rank0)])
    if dist.get_rank(group) == 0:
        return 0.0, 0.0
    return (lo + hi) / 2, max(0.0, (hi - lo) / 2)


def to_rank0_clock(spans: list[dict], origin: float, theta: float) -> list[dict]:
    """This rank's spans (ms from its origin) in milliseconds of rank 0's clock."""
    shift = (origin - theta) * 1000.0
    return [{**s, "start_ms": s["start_ms"] + shift, "end_ms": s["end_ms"] + shift} for s in spans]


def gather_stage_clocks(pc, origin: float, theta: float, u: float) -> list | None:
    """Rank 0: per stage (the dp = tp = cp = 0 rank that records it), (origin in rank 0's
    clock in ms, uncertainty in ms); others: None."""
    first = pc.dp_rank == 0 and pc.tp_rank == 0 and getattr(pc, "cp_rank", 0) == 0
    mine = ((origin - theta) * 1000.0, u * 1000.0) if first else None
    got: list | None = [None] * pc.world_size if pc.rank == 0 else None
    dist.gather_object((pc.pp_rank, mine), got, dst=0, group=pc.world_group)
    if got is None:
        return None
    out: list = [None] * pc.pp_size
    for stage, clock in got:
        if clock is not None:
            out[stage] = clock
    return out


def rebase(spans: list[dict], stage_clocks: list, own_origin_ms: float) -> tuple[list[dict], dict]:
    """Rank 0: the gathered spans (in its clock, ms) from the earliest origin, and the clock
    record: each stage's origin relative to rank 0's (its barrier exit, aligned) and its
    offset's uncertainty, in ms."""
    base = min([own_origin_ms, *(s["start_ms"] for s in spans)])
    out = [{**s, "start_ms": s["start_ms"] - base, "end_ms": s["end_ms"] - base} for s in spans]
    info = {
        "offsets_ms": [round(c[0] - own_origin_ms, 6) if c else 0.0 for c in stage_clocks],
        "uncertainty_ms": [round(c[1], 6) if c else 0.0 for c in stage_clocks],
    }
    return out, info
