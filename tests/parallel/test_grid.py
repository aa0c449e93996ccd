"""The grid table (grid.py): group lists follow from the table alone, so a dimension is a row
plus its derived groups. Pure arithmetic, no process group."""

from __future__ import annotations

import itertools

import pytest

from nanotron_parallel import grid
from nanotron_parallel.grid import (
    GROUP_KINDS,
    ParallelConfigError,
    check_degrees,
    coords_at,
    group_rank_lists,
    rank_at,
)


def test_the_table_lists_every_dimension_once_and_in_the_grid() -> None:
    names = [d.name for d in grid.DIMENSIONS]
    assert names == ["dp", "cp", "tp", "pp", "ep"]
    assert grid.GRID_ORDER == ("pp", "edp", "ep", "cp", "tp")
    assert list(GROUP_KINDS) == ["tp", "dp", "pp", "mp", "cp", "dp_cp", "ep", "edp_cp"]
    assert grid.DERIVED_GROUPS == {
        "dp": ("edp", "ep"),
        "mp": ("pp", "tp"),
        "dp_cp": ("edp", "ep", "cp"),
        "edp_cp": ("edp", "cp"),
    }


def test_expert_parallel_splits_dp_and_leaves_the_rank_numbers() -> None:
    """ep inside dp: dp_rank = edp_rank * ep + ep_rank, a rank's number is the one of the
    (pp, dp, cp, tp) grid, an ep group is ep consecutive dp ranks and the expert reduction
    group holds the ranks with the same ep_rank."""
    sizes = {"pp": 2, "dp": 4, "ep": 2, "cp": 1, "tp": 2}
    world = 16

    def at(p: int, d: int, t: int) -> int:  # written from the definition, ep not involved
        return (p * 4 + d) * 2 + t

    for r in range(world):
        c = coords_at(sizes, r)
        assert rank_at(sizes, c) == r == at(c["pp"], c["dp"], c["tp"])
        assert c["dp"] == c["edp"] * 2 + c["ep"]
    assert coords_at(sizes, 13) == {"pp": 1, "edp": 1, "ep": 0, "cp": 0, "tp": 1, "dp": 2}
    lists = group_rank_lists(dp=4, tp=2, pp=2, ep=2)
    expected_ep = [
        [at(p, 2 * e, t), at(p, 2 * e + 1, t)] for p, e, t in itertools.product(*[range(2)] * 3)
    ]
    assert lists["ep"] == expected_ep
    assert lists["edp_cp"][0] == [at(0, 0, 0), at(0, 2, 0)]
    assert lists["dp"] == group_rank_lists(dp=4, tp=2, pp=2)["dp"]
    for kind in GROUP_KINDS:
        assert sorted(r for g in lists[kind] for r in g) == list(range(world)), kind


def test_with_cp_the_expert_group_spans_edp_and_cp() -> None:
    lists = group_rank_lists(dp=2, tp=1, pp=1, cp=2, ep=2)
    # rank = dp_rank * cp + cp_rank: ep pairs dp ranks at the same cp rank
    assert lists["ep"] == [[0, 2], [1, 3]]
    assert lists["edp_cp"] == [[0, 1], [2, 3]]
    assert lists["dp_cp"] == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        ({"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 4}, "ep=4 must divide dp=2"),
        ({"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 0}, "ep=0 must be a positive integer"),
    ],
)
def test_an_ep_outside_dp_is_refused_in_one_line(sizes: dict, words: str) -> None:
    with pytest.raises(ParallelConfigError, match=words) as info:
        check_degrees(sizes, 2)
    assert "\n" not in str(info.value)


def test_the_world_size_error_names_ep_only_when_used() -> None:
    with pytest.raises(ParallelConfigError) as info:
        check_degrees({"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 2}, 4)
    assert str(info.value).startswith("dp*tp*pp must equal the world size: dp=2 * tp=1 * pp=1")
    assert "(got" not in str(info.value) and "ep" not in str(info.value).split(":")[0]
