"""Expert-parallel dispatch: at world 2 (gloo), both dispatchers route every (token, slot)
row to the rank owning its expert and back, with uneven splits (most rows to one expert), and
give the values and gradients one process gets with every expert local."""

from __future__ import annotations

import pytest
import torch

from nanotron_parallel import ParallelConfigError
from nanotron_parallel.expert_parallel import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    LocalDispatcher,
    make_dispatcher,
)
from nanotron_parallel.testing import run_distributed

E, K, T, H = 4, 2, 12, 8


def _routing(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    # Imbalanced: most slots go to expert 3; a few tokens pick experts 0 and 1; none picks 2
    # on rank 0 (an empty split both ways).
    idx = torch.full((T, K), 3, dtype=torch.int64)
    idx[:, 1] = torch.randint(0, 2, (T,), generator=g)
    weight = torch.rand(T, K, generator=g)
    return x, idx, weight


def _experts(tokens, counts, w, first):
    """Row r of local expert e: tokens[r] @ w[first + e] (a loop over local experts)."""
    parts = tokens.split(counts.tolist())
    out = [rows @ w[first + e] for e, rows in enumerate(parts)]
    return torch.cat(out) if out else tokens[:0]


def _run(dispatcher, x, idx, weight, w):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    d = dispatcher.dispatch(x, idx, weight)
    y = _experts(d.tokens, d.counts, w, dispatcher.first_local_expert)
    out = dispatcher.combine(y, d.state)
    (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
    return out.detach(), x.grad, weight.grad, d.counts


def dispatch_worker() -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    out = {kind: _compare(kind, group) for kind in ("alltoall", "allgather")}
    dist.destroy_process_group()
    return out


def _compare(kind: str, group) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    w = torch.randn(E, H, H, generator=torch.Generator().manual_seed(7)).requires_grad_()
    cls = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}[kind]
    dispatcher = make_dispatcher(kind, E, group)
    assert type(dispatcher) is cls and dispatcher.first_local_expert == 2 * rank
    out, gx, gweight, counts = _run(dispatcher, *_routing(rank), w)
    grad_w = w.grad.clone()
    dist.all_reduce(grad_w)  # the expert weights' gradient summed over the two ranks' tokens
    # Reference: one process, every expert local, both ranks' tokens.
    w.grad = None
    ref = [_run(LocalDispatcher(E), *_routing(r), w) for r in range(2)]
    return {
        "out": (out - ref[rank][0]).abs().max().item(),
        "gx": (gx - ref[rank][1]).abs().max().item(),
        "gweight": (gweight - ref[rank][2]).abs().max().item(),
        "gw": (grad_w - w.grad).abs().max().item(),
        "counts": counts.tolist(),
        "scale": ref[rank][0].abs().max().item(),
    }


@pytest.fixture(scope="module")
def launch() -> list[dict]:
    return run_distributed(dispatch_worker, 2, timeout=120)  # both dispatchers, one launch


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_dispatch_and_combine_match_one_process_with_uneven_splits(
    launch: list[dict], kind: str
) -> None:
    results = [r[kind] for r in launch]
    for r in results:
        assert r["scale"] > 0.1
        for key in ("out", "gx", "gweight", "gw"):
            assert r[key] < 1e-5, (key, r)
    # rank 0 owns experts 0, 1 (the second slots: T rows over both ranks), rank 1 experts 2,
    # 3 (expert 3 holds every first slot: 2T rows; expert 2 none)
    assert sum(results[0]["counts"]) == 2 * T
    assert results[1]["counts"] == [0, 2 * T]


def test_one_rank_gets_the_local_dispatcher_and_a_bad_kind_is_one_line() -> None:
    assert type(make_dispatcher("alltoall", E, None)) is LocalDispatcher
    with pytest.raises(ParallelConfigError, match="token_dispatcher_type='ring'"):
        make_dispatcher("ring", E, None)
