"""Placement of a model's blocks on pipeline stages, balanced by estimated compute.

Stages hold contiguous blocks. Pinned blocks stay at the ends (the embedding on the first
stage; the final norm, lm_head and loss on the last) and every stage gets at least one free
block (a decoder layer), so pp can be anything from 1 to the number of free blocks. Among the
valid cuts we take the one whose most expensive stage is cheapest: the step time of a
pipeline is set by its slowest stage.
"""

from __future__ import annotations

from collections.abc import Sequence


class PipelineConfigError(ValueError):
    """An impossible pipeline layout (pp out of range, bad costs or pins)."""


def _normalise(indices: Sequence[int], n: int, what: str) -> list[int]:
    out = []
    for i in indices:
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise PipelineConfigError(f"{what} block index {i} is out of range for {n} blocks")
        out.append(j)
    return out


def partition_blocks(
    costs: Sequence[float],
    pp: int,
    first: Sequence[int] = (0,),
    last: Sequence[int] = (-1,),
) -> list[range]:
    """Split blocks 0..len(costs)-1 into `pp` contiguous ranges of balanced cost.

    `first` and `last` are block indices (negative counts from the end) that must sit on the
    first and last stage. Raises PipelineConfigError when pp < 1 or when pp exceeds the number
    of free blocks between the pins.
    """
    n = len(costs)
    if n == 0:
        raise PipelineConfigError("cannot partition a model with no blocks")
    if any(c < 0 for c in costs):
        raise PipelineConfigError(f"block costs must be >= 0, got {list(costs)}")
    if pp < 1:
        raise PipelineConfigError(f"parallelism.pp must be >= 1, got {pp}")
    if pp == 1:
        return [range(0, n)]
    lo = max(_normalise(first, n, "first-stage"), default=-1) + 1  # free blocks start here
    hi = min(_normalise(last, n, "last-stage"), default=n)  # ... and end before here
    n_free = hi - lo
    if n_free < pp:
        raise PipelineConfigError(
            f"parallelism.pp={pp} is larger than the number of blocks that can be split "
            f"between stages ({max(n_free, 0)}, e.g. decoder layers): use pp <= {max(n_free, 1)}"
        )

    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    bounds = range(lo + 1, hi)  # cut positions that leave every stage a free block
    # The slowest stage sets the step time: minimise it first; among the cuts that reach it,
    # take the most even one (least sum of squared stage costs).
    slowest, _ = _best_cuts(prefix, pp, bounds, cap=None)
    _, cuts = _best_cuts(prefix, pp, bounds, cap=slowest * (1 + 1e-9) + 1e-12)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def _best_cuts(
    prefix: list[float], pp: int, bounds: range, cap: float | None
) -> tuple[float, list[int]]:
    """Dynamic programme over cut positions. Without `cap` it minimises the largest stage
    cost; with it, the sum of squared stage costs over stages costing at most `cap`.
    Returns (best value, stage boundaries [0, ..., n])."""
    n = len(prefix) - 1
    inf = float("inf")
    # best[k][j]: best value when the first k stages hold blocks [0, j); cut[k][j]: where the
    # k-th stage starts in that solution.
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for j in [n] if k == pp else bounds:
            for i in [0] if k == 1 else [b for b in bounds if b < j]:
                c = prefix[j] - prefix[i]
                if cap is None:
                    value = max(best[k - 1][i], c)
                else:
                    value = best[k - 1][i] + c * c if c <= cap else inf
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    ends = [n]
    for k in range(pp, 0, -1):
        ends.append(cut[k][ends[-1]])
    return best[pp][n], ends[::-1]


def pinned_ends(
    block_names: Sequence[str], free_prefix: str = "decoder."
) -> tuple[list[int], list[int]]:
    """The leading and trailing blocks whose names do not start with `free_prefix`."""
    free = [i for i, name in enumerate(block_names) if name.startswith(free_prefix)]
    if not free:
        return [0], [len(block_names) - 1]
    return list(range(0, free[0])), list(range(free[-1] + 1, len(block_names)))


def stage_block_names(
    block_names: Sequence[str],
    costs: Sequence[float],
    pp: int,
    pp_rank: int,
    free_prefix: str = "decoder.",
) -> list[str]:
    """The names of the blocks stage `pp_rank` holds. The blocks named `free_prefix...` (a
    family's layers: its row's `layer_prefix`) are placed by cost; those before them stay on
    the first stage and those after on the last (the embedding; the norm, head and loss)."""
    if len(block_names) != len(costs):
        raise PipelineConfigError(f"{len(block_names)} block names but {len(costs)} costs")
    if not 0 <= pp_rank < pp:
        raise PipelineConfigError(f"pp_rank {pp_rank} is out of range for pp={pp}")
    first, last = pinned_ends(block_names, free_prefix)
    ranges = partition_blocks(costs, pp, first=first, last=last)
    return [block_names[i] for i in ranges[pp_rank]]
