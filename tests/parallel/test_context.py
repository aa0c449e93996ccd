"""ParallelContext: the rank grid (pure), bad input, and real gloo groups in 1, 4 and 8 processes.

Layouts are (dp, tp, pp, cp): the grid is (pp, dp, cp, tp), tp fastest."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from nanotron_parallel import (
    ParallelConfigError,
    ParallelContext,
    grid_coords,
    group_rank_lists,
    rank_grid,
)
from nanotron_parallel.testing import run_distributed

LAYOUTS = [
    (dp, tp, pp, cp)
    for dp, tp, pp, cp in itertools.product(range(1, 9), repeat=4)
    if dp * tp * pp * cp <= 8
]
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


KINDS = ("tp", "dp", "pp", "mp", "cp", "dp_cp")


def _expected_groups(rank: int, dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, list[int]]:
    """Members of each group of `rank`, written from the definition, not from the code."""
    t, c, d, p = rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)

    def at(dd: int, tt: int, ppp: int, cc: int) -> int:
        return ppp * dp * cp * tp + dd * cp * tp + cc * tp + tt

    return {
        "tp": [at(d, x, p, c) for x in range(tp)],
        "dp": [at(x, t, p, c) for x in range(dp)],
        "pp": [at(d, t, x, c) for x in range(pp)],
        "mp": sorted(at(d, tt, pp_, c) for pp_ in range(pp) for tt in range(tp)),
        "cp": [at(d, t, p, x) for x in range(cp)],
        "dp_cp": sorted(at(dd, t, p, cc) for dd in range(dp) for cc in range(cp)),
    }


@pytest.mark.parametrize("dp,tp,pp,cp", LAYOUTS)
def test_rank_grid_and_groups_for_every_layout(dp: int, tp: int, pp: int, cp: int) -> None:
    world = dp * tp * pp * cp
    grid = rank_grid(dp, tp, pp, cp)
    flat = [r for plane in grid for row in plane for chunk in row for r in chunk]
    assert sorted(flat) == list(range(world))
    lists = group_rank_lists(dp, tp, pp, cp)
    sizes = [dp * pp * cp, tp * pp * cp, dp * tp * cp, dp * cp, dp * pp * tp, pp * tp]
    assert [len(lists[k]) for k in KINDS] == sizes
    for kind, groups in lists.items():
        # Each kind partitions the world.
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
    for rank in range(world):
        d, t, p, c = grid_coords(rank, dp, tp, pp, cp)
        assert grid[p][d][c][t] == rank
        assert rank == p * dp * cp * tp + d * cp * tp + c * tp + t
        expected = _expected_groups(rank, dp, tp, pp, cp)
        for kind in KINDS:
            holding = [g for g in lists[kind] if rank in g]
            assert holding == [expected[kind]], (kind, rank)


def test_rank_grid_small_example() -> None:
    assert rank_grid(2, 2, 2) == [[[[0, 1]], [[2, 3]]], [[[4, 5]], [[6, 7]]]]
    assert grid_coords(5, 2, 2, 2) == (0, 1, 1, 0)
    # cp sits between dp and tp: (pp=1, dp=2, cp=2, tp=2)
    assert rank_grid(2, 2, 1, cp=2) == [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
    assert grid_coords(6, 2, 2, 1, cp=2) == (1, 0, 0, 1)
    assert group_rank_lists(2, 1, 1, cp=2)["dp_cp"] == [[0, 1, 2, 3]]
    assert group_rank_lists(2, 1, 1, cp=2)["cp"] == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"dp": 0}, "dp=0"),
        ({"tp": -2}, "tp=-2"),
        ({"pp": 1.5}, "pp=1.5"),
        ({"dp": 2, "tp": 2}, "dp=2 * tp=2 * pp=1 = 4, but world_size=1"),
        ({"cp": 0}, "cp=0"),
        ({"cp": 2}, "dp*cp*tp*pp must equal the world size: dp=1 * cp=2 * tp=1 * pp=1 = 2"),
    ],
)
def test_bad_degrees_raise_before_any_group(
    kwargs: dict, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ParallelConfigError, match=needle.replace("*", r"\*").replace(".", r"\.")):
        ParallelContext(**kwargs)
    assert not dist.is_initialized()
    assert issubclass(ParallelConfigError, ValueError)


def test_world_size_mismatch_names_all_four_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ParallelConfigError) as err:
        ParallelContext(dp=2, tp=2, pp=2)
    assert "dp=2" in str(err.value) and "pp=2" in str(err.value)
    assert "= 8, but world_size=6" in str(err.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"RANK": "0"}, "WORLD_SIZE is required"),
        ({"RANK": "zero", "WORLD_SIZE": "1"}, "RANK='zero' is not an integer"),
        ({"RANK": "3", "WORLD_SIZE": "1"}, "RANK=3 is outside"),
        ({"RANK": "0", "WORLD_SIZE": "1"}, "MASTER_ADDR is required"),
    ],
)
def test_broken_torchrun_environment(
    env: dict, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ParallelConfigError, match=needle):
        ParallelContext()
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_nccl_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ParallelConfigError, match="backend='nccl' needs CUDA"):
        ParallelContext(backend="nccl")
    assert not dist.is_initialized()


def test_world_of_one_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    pc = ParallelContext()
    try:
        assert (pc.world_size, pc.rank, pc.backend, pc.device) == (
            1,
            0,
            "gloo",
            torch.device("cpu"),
        )
        assert (pc.dp_rank, pc.tp_rank, pc.pp_rank, pc.cp_rank) == (0, 0, 0, 0)
        assert pc.tp_ranks == pc.dp_ranks == pc.pp_ranks == pc.mp_ranks == [0]
        assert pc.cp_ranks == pc.dp_cp_ranks == [0] and (pc.cp_size, pc.dp_cp_size) == (1, 1)
        assert pc.is_first_stage and pc.is_last_stage
        assert pc.prev_stage_rank is None and pc.next_stage_rank is None
        x = torch.tensor([3.0])
        dist.all_reduce(x, group=pc.tp_group)  # a real (HashStore) group runs collectives
        assert x.item() == 3.0
        assert dist.get_world_size(pc.new_groups([[0]])) == 1
        with pytest.raises(ParallelConfigError, match=r"outside \[0, world_size=1\)"):
            pc.new_groups([[0, 1]])
    finally:
        pc.destroy()
    assert not dist.is_initialized()


def _group_info(pc: ParallelContext) -> dict:
    sums = {}
    for kind in KINDS:
        x = torch.tensor([float(pc.rank)])
        dist.all_reduce(x, group=getattr(pc, f"{kind}_group"))
        sums[kind] = x.item()
    return {
        "rank": pc.rank,
        "coords": (pc.dp_rank, pc.tp_rank, pc.pp_rank, pc.cp_rank),
        "dp_cp_rank": pc.dp_cp_rank,
        "groups": {k: list(getattr(pc, f"{k}_ranks")) for k in KINDS},
        "sums": sums,
        "stages": (pc.prev_stage_rank, pc.next_stage_rank, pc.is_first_stage, pc.is_last_stage),
    }


def grid_worker(layouts: list[tuple[int, int, int, int]]) -> dict:
    """Each layout over one default group; every rank sees every rank's view via all_gather."""
    dp0, tp0, pp0, cp0 = layouts[0]
    base = ParallelContext(dp=dp0, tp=tp0, pp=pp0, cp=cp0)
    world = base.world_size
    out: dict = {"layouts": {}}
    for dp, tp, pp, cp in layouts:
        pc = base if (dp, tp, pp, cp) == layouts[0] else ParallelContext(dp, tp, pp, cp=cp)
        views: list = [None] * world
        dist.all_gather_object(views, _group_info(pc))
        # Ranks that share a group must agree on its members.
        for kind in KINDS:
            for view in views:
                for member in view["groups"][kind]:
                    assert views[member]["groups"][kind] == view["groups"][kind], (kind, view)
        # A tied group between the first and last stage of each (dp, cp, tp) triple.
        pairs = [
            [pc.rank_of(d, t, 0, c), pc.rank_of(d, t, pp - 1, c)]
            for d in range(dp)
            for c in range(cp)
            for t in range(tp)
        ]
        pairs = [sorted(set(p)) for p in pairs]
        tied = pc.new_groups(pairs)
        mine = [p for p in pairs if pc.rank in p]
        if mine:
            x = torch.tensor([float(pc.rank)])
            dist.all_reduce(x, group=tied)
            assert x.item() == float(sum(mine[0])), (x.item(), mine)
        else:
            assert tied is None  # a middle stage is in no tied group
        out["layouts"][(dp, tp, pp, cp)] = views
        if pc is not base:
            pc.destroy()
            assert dist.is_initialized()  # not its default group to destroy
    base.destroy()
    out["destroyed"] = not dist.is_initialized()
    out["env"] = {k: os.environ[k] for k in TORCHRUN_ENV}
    out["threads"] = torch.get_num_threads()
    return out


def _check_grid_results(results: list[dict], layouts: list[tuple[int, int, int, int]]) -> None:
    world = len(results)
    for rank, res in enumerate(results):
        assert res["destroyed"] is True
        # run_distributed's torchrun environment and one thread per process.
        env = res["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world)
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert res["threads"] == 1
        for layout in layouts:
            dp, tp, pp, cp = layout
            views = res["layouts"][layout]
            assert views == results[0]["layouts"][layout]  # every rank saw the same
            for q, view in enumerate(views):
                assert view["rank"] == q
                assert view["coords"] == grid_coords(q, dp, tp, pp, cp)
                expected = _expected_groups(q, dp, tp, pp, cp)
                assert view["groups"] == expected
                assert view["sums"] == {k: float(sum(v)) for k, v in expected.items()}
                d, t, p, c = view["coords"]
                assert view["dp_cp_rank"] == expected["dp_cp"].index(q) == d * cp + c
                prev = None if p == 0 else q - dp * cp * tp
                nxt = None if p == pp - 1 else q + dp * cp * tp
                assert view["stages"] == (prev, nxt, p == 0, p == pp - 1)


def test_groups_in_eight_processes() -> None:
    # Every layout's grid is checked in one process above; here the real groups of the layouts
    # that exercise each dimension at 8 (group creation dominates the time of these tests).
    # (every dimension at 2 at once, and cp at 4: the 4-process test covers the rest)
    layouts = [(2, 2, 2, 1), (1, 2, 1, 4)]
    _check_grid_results(run_distributed(grid_worker, 8, layouts, timeout=300), layouts)


def test_groups_in_four_processes() -> None:
    layouts = [(2, 2, 1, 1), (1, 2, 2, 1), (4, 1, 1, 1), (1, 1, 2, 2)]
    _check_grid_results(run_distributed(grid_worker, 4, layouts, timeout=240), layouts)
