"""Stage placement: contiguous, pinned ends, every stage with a free block, min-max balanced."""

from __future__ import annotations

import itertools
import random

import pytest

from nanotron_parallel.pipeline import PipelineConfigError, partition_blocks, stage_block_names


def _brute_force_best(costs: list[float], pp: int, lo: int, hi: int) -> float:
    """The smallest maximum stage cost over every valid set of cuts."""
    best = float("inf")
    for cuts in itertools.combinations(range(lo + 1, hi), pp - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_uniform_costs_split_evenly() -> None:
    assert partition_blocks([1.0] * 6, 2) == [range(0, 3), range(3, 6)]
    assert partition_blocks([1.0] * 6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert partition_blocks([1.0] * 6, 1) == [range(0, 6)]


def test_pins_stay_on_the_end_stages_and_an_expensive_head_gets_fewer_layers() -> None:
    # embedding, 6 layers, norm, head (cost 4 layers), loss
    costs = [0.1] + [1.0] * 6 + [0.1, 4.0, 0.5]
    ranges = partition_blocks(costs, 3, first=(0,), last=(7, 8, 9))
    assert ranges[0].start == 0 and ranges[-1].stop == 10 and ranges[-1].start <= 7
    # 2 layers, 3 layers, 1 layer + norm/head/loss: the head stage is the slowest (5.6) and
    # the other two are as even as contiguous cuts allow.
    assert [len(r) for r in ranges] == [3, 3, 4]
    assert max(sum(costs[i] for i in r) for r in ranges) == pytest.approx(5.6)


@pytest.mark.parametrize("seed", range(6))
def test_min_max_cost_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(4, 10)
    costs = [round(rng.uniform(0.0, 5.0), 3) for _ in range(n)]
    first, last = (0,), (n - 2, n - 1)
    for pp in range(1, n - 2):
        ranges = partition_blocks(costs, pp, first=first, last=last)
        assert [i for r in ranges for i in r] == list(range(n))  # contiguous, complete, ordered
        assert all(len(r) > 0 for r in ranges)
        got = max(sum(costs[i] for i in r) for r in ranges)
        want = sum(costs) if pp == 1 else _brute_force_best(costs, pp, 0, n - 2)
        assert got == pytest.approx(want, rel=1e-12)


def test_every_stage_gets_a_free_block() -> None:
    costs = [100.0, 1.0, 1.0, 1.0, 100.0]  # heavy pinned ends must not starve a stage
    ranges = partition_blocks(costs, 3, first=(0,), last=(-1,))
    assert ranges == [range(0, 2), range(2, 3), range(3, 5)]


@pytest.mark.parametrize(
    ("costs", "pp", "kwargs", "match"),
    [
        ([1.0] * 5, 0, {}, "pp must be >= 1"),
        ([1.0] * 5, 4, {}, r"pp=4 is larger .* \(3, e.g. decoder layers\)"),
        ([1.0] * 5, 3, {"last": (-2, -1)}, "pp=3 is larger"),
        ([], 1, {}, "no blocks"),
        ([1.0, -1.0], 1, {}, ">= 0"),
        ([1.0] * 5, 2, {"first": (7,)}, "out of range"),
    ],
)
def test_impossible_layouts_are_clear_errors(costs, pp, kwargs, match) -> None:
    with pytest.raises(PipelineConfigError, match=match):
        partition_blocks(costs, pp, **kwargs)


def test_stage_block_names_pins_non_decoder_blocks() -> None:
    names = ["embedding", *[f"decoder.{i}" for i in range(4)], "final_norm", "lm_head", "loss"]
    costs = [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    stages = [stage_block_names(names, costs, 4, r) for r in range(4)]
    assert stages == [
        ["embedding", "decoder.0"],
        ["decoder.1"],
        ["decoder.2"],
        ["decoder.3", "final_norm", "lm_head", "loss"],
    ]
    with pytest.raises(PipelineConfigError, match="pp_rank 4"):
        stage_block_names(names, costs, 4, 4)
    with pytest.raises(PipelineConfigError, match="8 block names but 3 costs"):
        stage_block_names(names, costs[:3], 2, 0)
    with pytest.raises(PipelineConfigError, match="pp=5"):
        stage_block_names(names, costs, 5, 0)
