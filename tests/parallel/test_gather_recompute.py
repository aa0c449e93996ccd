"""tp_recompute_allgather: a REDUCE_SCATTER column-parallel linear that keeps only its input
shard gives the same outputs and gradients, and saves tp times less input for the backward."""

from __future__ import annotations

import torch

from nanotron_parallel.testing import run_distributed


def _worker(_unused: int) -> list[dict]:
    import torch.distributed as dist

    from nanotron_parallel import ColumnParallelLinear, ParallelContext
    from nanotron_parallel.testing import shared_default_group

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        pc = ParallelContext(dp=1, tp=2, pp=1)
        gen = torch.Generator().manual_seed(0)
        w, b = torch.randn(12, 16, generator=gen), torch.randn(12, generator=gen)
        x_full, grad_full = (
            torch.randn(8, 2, 16, generator=gen),
            torch.randn(8, 2, 12, generator=gen),
        )
        r = dist.get_rank(pc.tp_group)
        for async_comm in (False, True):
            for recompute in (False, True):
                layer = ColumnParallelLinear(16, 12, pc.tp_group, "REDUCE_SCATTER", bias=True,
                                             async_communication=async_comm, sections=[4, 8])  # fmt: skip
                layer.load_full(w, b)
                layer.recompute_allgather = recompute
                x = x_full.chunk(2, dim=0)[r].clone().requires_grad_()
                saved = []

                def pack(t, saved=saved):
                    saved.append(t.numel())
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = layer(x)
                y.backward(torch.cat([grad_full[:, :, :4].chunk(2, -1)[r],
                                      grad_full[:, :, 4:].chunk(2, -1)[r]], -1))  # fmt: skip
                out.append({
                    "key": (async_comm, recompute), "y": y.detach(), "gx": x.grad,
                    "gw": layer.weight.grad, "gb": layer.bias.grad, "saved": max(saved),
                })  # fmt: skip
        pc.destroy()
    return out


def test_recompute_allgather_same_results_less_saved():
    for rank_results in run_distributed(_worker, 2, 0, timeout=120):
        plain = {r["key"]: r for r in rank_results}
        for async_comm in (False, True):
            a, b = plain[(async_comm, False)], plain[(async_comm, True)]
            for key in ("y", "gx", "gw", "gb"):
                assert torch.allclose(a[key], b[key], rtol=1e-6, atol=1e-6), (async_comm, key)
            assert a["saved"] == 8 * 2 * 16  # the gathered input [s, b, in]
            assert b["saved"] == 4 * 2 * 16  # only the shard [s/tp, b, in] is kept
