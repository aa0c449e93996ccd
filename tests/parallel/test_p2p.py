"""P2P transfers between pipeline stages: exact round trips of any dtype, shape and layout."""

from __future__ import annotations

import os

import pytest
import torch

from nanotron_parallel.pipeline.p2p import P2PError, StageComm, TensorMeta

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)


def _sample(src: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    """A deterministic tensor every rank can rebuild: which one depends on (src, index)."""
    gen = torch.Generator().manual_seed(1000 * src + index)
    shape = [(3, 5), (2, 3, 4), (), (7,), (4, 6)][index % 5]
    base = torch.randn(shape, generator=gen) * 100
    if dtype == torch.bool:
        return base > 0
    return base.to(dtype)


def _layouts(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensor itself and non-contiguous views of it (transposed, strided slice)."""
    out = [t]
    if t.dim() >= 2:
        out.append(t.transpose(0, 1))
        out.append(t[..., ::2])
    return out


def _expected(src: int) -> list[torch.Tensor]:
    tensors = []
    for k, dtype in enumerate(DTYPES):
        for index in range(5):
            tensors.extend(_layouts(_sample(src, 10 * k + index, dtype)))
    return tensors


def _p2p_worker() -> dict[str, int]:

    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.pipeline.p2p import exchange, recv_tensor, send_tensor

    pc = ParallelContext(pp=int(os.environ["WORLD_SIZE"]))
    rank, world = pc.rank, pc.world_size
    checked = 0

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal checked
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
        assert got.is_contiguous()
        assert torch.equal(got, want)
        checked += 1

    # A ring: every rank sends to the next and receives from the previous in one batched call,
    # which would deadlock with blocking send-then-recv on every rank.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for sent, want in zip(_expected(rank), _expected(prv)):
        got = exchange(send=sent, dst=nxt, src=prv, group=pc.pp_group)
        check(got, want)

    # Plain blocking send / recv between the two ends, both directions.
    a, b = 0, world - 1
    if rank in (a, b):
        peer = b if rank == a else a
        for sent, want in zip(_expected(rank), _expected(peer)):
            if rank == a:
                send_tensor(sent, peer)
                got = recv_tensor(peer)
            else:
                got = recv_tensor(peer)
                send_tensor(sent, peer)
            check(got, want)

    # requires_grad travels in the header. Stages 0 and 1 as in 1F1B: single calls meet single
    # calls, and a combined call meets the mirrored combined call (the steady state).
    comm = StageComm.from_context(pc)
    act = torch.full((2, 3), float(rank + 1), requires_grad=True) * 1.0
    if pc.pp_rank == 0:
        comm.send_forward(act)
        check(comm.recv_backward(), torch.full((2, 3), 10.0))
        grad = comm.send_forward_recv_backward(act * 3)
        check(grad, torch.full((2, 3), 20.0))
        assert not grad.requires_grad
    elif pc.pp_rank == 1:
        x = comm.recv_forward()
        assert x.requires_grad and x.is_leaf
        check(x.detach(), torch.ones(2, 3))
        comm.send_backward(torch.full((2, 3), 10.0))
        x = comm.send_backward_recv_forward(torch.full((2, 3), 20.0))
        check(x.detach(), torch.full((2, 3), 3.0))
    pc.destroy()
    return {"rank": rank, "checked": checked}


def test_p2p_round_trip_exact_on_three_ranks() -> None:
    from nanotron_parallel.testing import run_distributed

    results = run_distributed(_p2p_worker, 3, timeout=120)
    n_ring = len(_expected(0))
    assert [r["rank"] for r in results] == [0, 1, 2]
    # Ring on every rank; end-to-end pair on ranks 0 and 2; StageComm check on ranks 0 and 1.
    assert [r["checked"] for r in results] == [2 * n_ring + 2, n_ring + 2, 2 * n_ring]


def test_header_round_trip_and_errors() -> None:
    meta = TensorMeta((2, 0, 5), torch.bfloat16, True)
    assert TensorMeta.from_header(meta.to_header(torch.device("cpu"))) == meta
    assert meta.nbytes == 0
    assert TensorMeta((3, 4), torch.int64, False).nbytes == 96
    with pytest.raises(P2PError, match="dtype"):
        TensorMeta((2,), torch.quint8, False).to_header(torch.device("cpu"))
    with pytest.raises(P2PError, match="dims"):
        TensorMeta((1,) * 13, torch.float32, False).to_header(torch.device("cpu"))
