"""The grid table (grid.py): group lists follow from the table alone, so a new dimension is a
row plus its derived groups. Pure arithmetic, no process group."""

from __future__ import annotations

import itertools

import pytest

from nanotron_parallel import grid
from nanotron_parallel.grid import GROUP_KINDS, coords_at, kind_rank_lists, rank_at


def test_the_table_lists_every_dimension_once_and_in_the_grid() -> None:
    names = [d.name for d in grid.DIMENSIONS]
    assert sorted(names) == sorted(grid.GRID_ORDER) == ["cp", "dp", "pp", "tp"]
    assert grid.GRID_ORDER == ("pp", "dp", "cp", "tp")
    assert list(GROUP_KINDS) == ["tp", "dp", "pp", "mp", "cp", "dp_cp"]
    assert grid.DERIVED_GROUPS == {"mp": ("pp", "tp"), "dp_cp": ("dp", "cp")}


def test_an_expert_dimension_is_one_row_plus_its_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ep between dp and cp, an expert group, and experts' gradients reduced over the
    data-parallel ranks that hold the same expert: what an ep row would give."""
    monkeypatch.setattr(grid, "GRID_ORDER", ("pp", "dp", "ep", "cp", "tp"))
    sizes = {"pp": 2, "dp": 2, "ep": 2, "cp": 1, "tp": 2}
    world = 16
    ranks = [rank_at(sizes, coords_at(sizes, r)) for r in range(world)]
    assert ranks == list(range(world))
    assert coords_at(sizes, 13) == {"pp": 1, "dp": 1, "ep": 0, "cp": 0, "tp": 1}

    def at(p: int, d: int, e: int, t: int) -> int:  # written from the definition
        return ((p * 2 + d) * 2 + e) * 2 + t

    ep_groups = kind_rank_lists(sizes, ("ep",))
    expected = [[at(p, d, 0, t), at(p, d, 1, t)] for p, d, t in itertools.product(*[range(2)] * 3)]
    assert ep_groups == expected
    expert_dp = kind_rank_lists(sizes, ("dp", "cp"))
    assert expert_dp[0] == [at(0, 0, 0, 0), at(0, 1, 0, 0)]
    for groups in (ep_groups, expert_dp, kind_rank_lists(sizes, ("dp", "ep", "cp"))):
        assert sorted(r for g in groups for r in g) == list(range(world))
