"""Tensor-parallel primitives vs plain torch, in real gloo groups of 1, 2 and 4 processes.

One launch per tp size runs every primitive in both modes (see tp_checks.py); the tests below
read its results, so a failure names the primitive and the quantity that is off.
"""

from __future__ import annotations

import pytest
import torch

from nanotron_parallel.testing import run_distributed
from tests.parallel import tp_checks

TOL = 1e-6
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
FAMILIES = ("column", "row", "embedding", "cross_entropy", "fused_loss", "collective")


@pytest.fixture(scope="module")
def tp_results() -> dict:
    """Lazily runs each tp size once per module; {tp: [each rank's result]}."""
    cache: dict = {}

    def get(tp: int) -> list[dict]:
        if tp not in cache:
            if tp == 1:  # a world of one, in this process, with no torchrun environment
                with pytest.MonkeyPatch.context() as mp:
                    for key in TORCHRUN_ENV:
                        mp.delenv(key, raising=False)
                    num_threads = torch.get_num_threads()
                    try:
                        cache[tp] = [tp_checks.tp_worker(1)]
                    finally:
                        torch.set_num_threads(num_threads)
            else:
                cache[tp] = run_distributed(tp_checks.tp_worker, tp, tp, timeout=240)
        return cache[tp]

    return get


def _family(name: str) -> str:
    return next(f for f in FAMILIES if f in name.split(".")[0] or f in name.split(".")[1])


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_primitive_matches_torch_reference(tp_results, tp: int, family: str) -> None:
    ranks = tp_results(tp)
    checked = 0
    for rank, res in enumerate(ranks):
        errs = {k: v for k, v in res["errs"].items() if _family(k) == family}
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"tp={tp} rank={rank}: relative errors above {TOL}: {bad}"
        checked += len(errs)
    # Every rank ran every check of the family (both modes where they apply).
    expected = {
        "column": 2 * 3 * 5,
        "row": 2 * 4,
        "embedding": 2 * 2,
        "cross_entropy": 3 * 2,
        "fused_loss": 3 * 2 * 5,  # vocabs x (z-loss off, on) x quantities
        "collective": 3 * 4 * 2 + 2 * 2,
    }[family]
    assert checked == expected * tp


def test_modes_and_padding_are_exercised(tp_results) -> None:
    names = set(tp_results(2)[0]["errs"])
    assert {"ALL_REDUCE.row.out", "REDUCE_SCATTER.row.out"} <= names
    assert {"cross_entropy_v5.grad", "cross_entropy_v15.loss", "cross_entropy_v16.loss"} <= names
    # tp=4, vocab 9 padded to 12: rank 3 holds only padding columns.
    assert "cross_entropy_v9.grad" in tp_results(4)[3]["errs"]


@pytest.mark.parametrize("tp", [2, 4])
def test_user_errors_have_clear_messages(tp_results, tp: int) -> None:
    messages = tp_results(tp)[0]["messages"]
    assert len(messages) == 7
    assert "async_communication=True" in messages[0]
    assert f"out_features={tp + 1} is not divisible by tp={tp}" in messages[1]
    assert "not divisible by the tensor-parallel size" in messages[5]
