"""The rank grid as a table of named dimensions, and the process-group kinds derived from it.

Pure arithmetic (no process group): `ParallelContext` builds its groups from these lists, and
checkpoints and tests read them too.

The grid is (pp, dp, cp, tp) with tp fastest, so the ranks of one tp group are consecutive and
sit on one node, and a cp group (context parallel, which exchanges keys and values every
layer) is the next closest:
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``.
With cp = 1 this is the (pp, dp, tp) grid of a 3D-parallel run, rank for rank.

A group kind is a set of grid dimensions: a group of that kind holds every rank whose
coordinates differ only along those dimensions, so each kind partitions the world. Every
dimension is a kind of its own; `DERIVED_GROUPS` adds the ones that span several. A new
dimension (expert parallel, say) is one `Dimension` row at its place in `GRID_ORDER` plus the
derived groups it needs (e.g. the group experts reduce their gradients over).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass


class ParallelConfigError(ValueError):
    """A parallel layout or shape that cannot work (names the offending numbers)."""


@dataclass(frozen=True)
class Dimension:
    """One axis of the grid. `name` gives the context's `<name>_size`, `<name>_rank`,
    `<name>_group` and `<name>_ranks`; `named_at_one`: whether error messages name it when
    its degree is 1 (dimensions added after 3D parallelism are named only when used)."""

    name: str
    named_at_one: bool = True


# The order errors and products name the degrees in ("dp*cp*tp*pp").
DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("dp"),
    Dimension("cp", named_at_one=False),
    Dimension("tp"),
    Dimension("pp"),
)
# Slowest to fastest: the rank is the row-major index of its coordinates in this order.
GRID_ORDER: tuple[str, ...] = ("pp", "dp", "cp", "tp")
# Groups spanning several dimensions, in the order they are created.
DERIVED_GROUPS: dict[str, tuple[str, ...]] = {
    # One model replica: every (pp, tp) rank that shares a dp_rank and a cp_rank.
    "mp": ("pp", "tp"),
    # The gradient reduction: every rank holding the same parameters (same pp, tp).
    "dp_cp": ("dp", "cp"),
}
# Every group kind, in the order the context creates them (the same on every rank).
GROUP_KINDS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "mp": DERIVED_GROUPS["mp"],
    "cp": ("cp",),
    "dp_cp": DERIVED_GROUPS["dp_cp"],
}

Degrees = dict[str, int]


def degrees(dp: int, tp: int, pp: int, cp: int = 1) -> Degrees:
    """The degrees by dimension name."""
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp}


def validate_degrees(dp: int, tp: int, pp: int, world_size: int | None = None, cp: int = 1) -> None:
    """Raise ParallelConfigError for a non-positive degree or dp*cp*tp*pp != world_size."""
    check_degrees(degrees(dp, tp, pp, cp), world_size)


def check_degrees(sizes: Degrees, world_size: int | None = None) -> None:
    """`validate_degrees` over a {name: degree} mapping holding every dimension."""
    got = ", ".join(f"{d.name}={sizes[d.name]}" for d in DIMENSIONS)
    for d in DIMENSIONS:
        value = sizes[d.name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ParallelConfigError(
                f"parallelism degree {d.name}={value!r} must be a positive integer (got {got})"
            )
    total = math.prod(sizes.values())
    if world_size is not None and total != world_size:
        named = [d.name for d in DIMENSIONS if d.named_at_one or sizes[d.name] != 1]
        factors = " * ".join(f"{n}={sizes[n]}" for n in named)
        raise ParallelConfigError(
            f"{'*'.join(named)} must equal the world size: {factors} = {total}, "
            f"but world_size={world_size}"
        )


def rank_at(sizes: Degrees, coords: dict[str, int]) -> int:
    """The global rank at `coords` (every dimension named; not range-checked)."""
    rank = 0
    for name in GRID_ORDER:
        rank = rank * sizes[name] + coords[name]
    return rank


def coords_at(sizes: Degrees, rank: int) -> dict[str, int]:
    """The coordinates of a global rank, by dimension name."""
    out = {}
    for name in reversed(GRID_ORDER):
        rank, out[name] = divmod(rank, sizes[name])
    return out


def rank_grid(dp: int, tp: int, pp: int, cp: int = 1) -> list[list[list[list[int]]]]:
    """Global ranks as nested lists ``grid[pp_rank][dp_rank][cp_rank][tp_rank]`` (tp fastest)."""
    validate_degrees(dp, tp, pp, cp=cp)
    sizes = degrees(dp, tp, pp, cp)

    def nest(level: int, offset: int) -> list:
        size = sizes[GRID_ORDER[level]]
        if level == len(GRID_ORDER) - 1:
            return [offset * size + i for i in range(size)]
        return [nest(level + 1, offset * size + i) for i in range(size)]

    return nest(0, 0)


def grid_coords(rank: int, dp: int, tp: int, pp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(dp_rank, tp_rank, pp_rank, cp_rank) of a global rank in the (pp, dp, cp, tp) grid
    (cp last, so the first three keep their places from the 3D grid)."""
    validate_degrees(dp, tp, pp, cp=cp)
    sizes = degrees(dp, tp, pp, cp)
    world = math.prod(sizes.values())
    if not 0 <= rank < world:
        raise ParallelConfigError(f"rank={rank} is outside [0, world_size={world})")
    c = coords_at(sizes, rank)
    return c["dp"], c["tp"], c["pp"], c["cp"]


def kind_rank_lists(sizes: Degrees, spans: tuple[str, ...]) -> list[list[int]]:
    """Every group spanning the dimensions `spans`, as sorted global-rank lists: one per
    combination of the other coordinates, those taken in grid order."""
    fixed = [n for n in GRID_ORDER if n not in spans]
    out = []
    for outer in itertools.product(*(range(sizes[n]) for n in fixed)):
        coords = dict(zip(fixed, outer))
        members = []
        for inner in itertools.product(*(range(sizes[n]) for n in spans)):
            coords.update(zip(spans, inner))
            members.append(rank_at(sizes, coords))
        out.append(sorted(members))
    return out


def group_rank_lists(dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of each kind ("tp", "dp", "pp", "mp", "cp", "dp_cp") as sorted global-rank
    lists. Each kind partitions the world."""
    validate_degrees(dp, tp, pp, cp=cp)
    sizes = degrees(dp, tp, pp, cp)
    return {kind: kind_rank_lists(sizes, spans) for kind, spans in GROUP_KINDS.items()}
