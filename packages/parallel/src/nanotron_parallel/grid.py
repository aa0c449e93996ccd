"""The rank grid as a table of named dimensions, and the process-group kinds derived from it.

Pure arithmetic (no process group): `ParallelContext` builds its groups from these lists, and
checkpoints and tests read them too.

The grid is (pp, dp, cp, tp) with tp fastest, so the ranks of one tp group are consecutive and
sit on one node, and a cp group (context parallel, which exchanges keys and values every
layer) is the next closest:
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``.
With cp = 1 this is the (pp, dp, tp) grid of a 3D-parallel run, rank for rank.

Expert parallel (ep) is a sub-dimension of data parallel, not a factor of the world: the dp
ranks split into ``dp = edp * ep`` with ``dp_rank = edp_rank * ep + ep_rank`` (ep fastest
inside dp, so an ep group is consecutive dp ranks). ep ranks see different tokens as every dp
rank does, so no replica is spent on experts; a rank's global number does not depend on ep.
The grid's axes (`GRID_ORDER`) are therefore (pp, edp, ep, cp, tp), and dp is the derived
kind (edp, ep).

A group kind is a set of grid axes: a group of that kind holds every rank whose coordinates
differ only along those axes, so each kind partitions the world. `DERIVED_GROUPS` lists the
kinds spanning several axes (their size and this rank's index in them are derived too).
A new dimension is one `Dimension` row at its place in `GRID_ORDER` plus the derived groups
it needs.
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
    # The dimension it subdivides (ep: dp), or None for a factor of the world size.
    inside: str | None = None


# The order errors and products name the degrees in ("dp*cp*tp*pp").
DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("dp"),
    Dimension("cp", named_at_one=False),
    Dimension("tp"),
    Dimension("pp"),
    Dimension("ep", named_at_one=False, inside="dp"),
)
# The grid's axes, slowest to fastest: the rank is the row-major index of its coordinates in
# this order. dp is split into (edp, ep); with ep = 1 this is the (pp, dp, cp, tp) grid.
GRID_ORDER: tuple[str, ...] = ("pp", "edp", "ep", "cp", "tp")
# Group kinds spanning several axes, in the order they are created.
DERIVED_GROUPS: dict[str, tuple[str, ...]] = {
    # The data-parallel ranks: every rank holding the same dense parameters of one cp slice.
    "dp": ("edp", "ep"),
    # One model replica: every (pp, tp) rank that shares a dp_rank and a cp_rank.
    "mp": ("pp", "tp"),
    # The gradient reduction of dense parameters: every rank holding them (same pp, tp).
    "dp_cp": ("edp", "ep", "cp"),
    # The gradient reduction (and ZeRO group) of expert parameters: every rank holding the
    # same experts (same pp, tp, ep_rank).
    "edp_cp": ("edp", "cp"),
}
# Every group kind, in the order the context creates them (the same on every rank).
GROUP_KINDS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "dp": DERIVED_GROUPS["dp"],
    "pp": ("pp",),
    "mp": DERIVED_GROUPS["mp"],
    "cp": ("cp",),
    "dp_cp": DERIVED_GROUPS["dp_cp"],
    # Expert parallel: the ranks a MoE layer's tokens are dispatched over.
    "ep": ("ep",),
    "edp_cp": DERIVED_GROUPS["edp_cp"],
}

Degrees = dict[str, int]


def degrees(dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> Degrees:
    """The degrees by dimension name."""
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}


def axis_sizes(sizes: Degrees) -> Degrees:
    """The sizes of the grid's axes (GRID_ORDER) from the degrees (edp = dp / ep)."""
    if "edp" in sizes:
        return sizes
    ep = sizes.get("ep", 1)
    return {
        "pp": sizes["pp"],
        "edp": sizes["dp"] // ep,
        "ep": ep,
        "cp": sizes["cp"],
        "tp": sizes["tp"],
    }


def validate_degrees(
    dp: int, tp: int, pp: int, world_size: int | None = None, cp: int = 1, ep: int = 1
) -> None:
    """Raise ParallelConfigError for a non-positive degree, an ep that does not divide dp or
    dp*cp*tp*pp != world_size."""
    check_degrees(degrees(dp, tp, pp, cp, ep), world_size)


def check_degrees(sizes: Degrees, world_size: int | None = None) -> None:
    """`validate_degrees` over a {name: degree} mapping holding every dimension."""
    sizes = {d.name: sizes.get(d.name, 1) for d in DIMENSIONS}
    got = ", ".join(
        f"{d.name}={sizes[d.name]}" for d in DIMENSIONS if d.named_at_one or sizes[d.name] != 1
    )
    for d in DIMENSIONS:
        value = sizes[d.name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ParallelConfigError(
                f"parallelism degree {d.name}={value!r} must be a positive integer (got {got})"
            )
        if d.inside is not None and sizes[d.inside] % value:
            raise ParallelConfigError(
                f"{d.name}={value} must divide {d.inside}={sizes[d.inside]}: its ranks are a "
                f"subset of the {d.inside} ranks (got {got})"
            )
    world = [d for d in DIMENSIONS if d.inside is None]
    total = math.prod(sizes[d.name] for d in world)
    if world_size is not None and total != world_size:
        named = [d.name for d in world if d.named_at_one or sizes[d.name] != 1]
        factors = " * ".join(f"{n}={sizes[n]}" for n in named)
        raise ParallelConfigError(
            f"{'*'.join(named)} must equal the world size: {factors} = {total}, "
            f"but world_size={world_size}"
        )


def rank_at(sizes: Degrees, coords: dict[str, int]) -> int:
    """The global rank at `coords` (every axis named, or dp in place of edp and ep; not
    range-checked). `sizes`: the degrees or the axis sizes."""
    sizes = axis_sizes(sizes)
    if "edp" not in coords:
        edp, ep = divmod(coords["dp"], sizes["ep"])
        coords = {**coords, "edp": edp, "ep": ep}
    rank = 0
    for name in GRID_ORDER:
        rank = rank * sizes[name] + coords[name]
    return rank


def coords_at(sizes: Degrees, rank: int) -> dict[str, int]:
    """The coordinates of a global rank by axis name, and its dp rank (edp_rank * ep + ep_rank)."""
    sizes = axis_sizes(sizes)
    out = {}
    for name in reversed(GRID_ORDER):
        rank, out[name] = divmod(rank, sizes[name])
    out["dp"] = out["edp"] * sizes["ep"] + out["ep"]
    return out


def rank_grid(dp: int, tp: int, pp: int, cp: int = 1) -> list[list[list[list[int]]]]:
    """Global ranks as nested lists ``grid[pp_rank][dp_rank][cp_rank][tp_rank]`` (tp fastest)."""
    validate_degrees(dp, tp, pp, cp=cp)
    sizes, order = degrees(dp, tp, pp, cp), ("pp", "dp", "cp", "tp")  # ep does not renumber

    def nest(level: int, offset: int) -> list:
        size = sizes[order[level]]
        if level == len(order) - 1:
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
    """Every group spanning the axes `spans`, as sorted global-rank lists: one per
    combination of the other coordinates, those taken in grid order."""
    sizes = axis_sizes(sizes)
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


def group_rank_lists(
    dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1
) -> dict[str, list[list[int]]]:
    """Every group of each kind (`GROUP_KINDS`: "tp", "dp", "pp", "mp", "cp", "dp_cp", "ep",
    "edp_cp") as sorted global-rank lists. Each kind partitions the world."""
    validate_degrees(dp, tp, pp, cp=cp, ep=ep)
    sizes = degrees(dp, tp, pp, cp, ep)
    return {kind: kind_rank_lists(sizes, spans) for kind, spans in GROUP_KINDS.items()}
