"""All-gather attention (as the Llama 3 paper): every rank gathers the whole sequence's K/V.

K and V are all-gathered over the cp group in one collective (grouped-query attention gathers
only the kv heads), put back in sequence order, and the kernel runs twice: chunk r against keys
[0, (r+1)C), chunk 2cp-1-r against keys [0, (2cp-r)C), with the global positions of both (for a
mask-free model that is the bottom-right causal kernel). The autograd function saves only the
local q, k, v: the backward gathers K and V again, recomputes the two kernel calls, and
reduce-scatters dK and dV back to their owners. Saved activations scale as 1/cp; the gathered
K/V (the whole sequence's) exist only inside the forward and inside the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron_parallel.tensor_parallel.functional import (
    _all_gather_tensor,
    _reduce_scatter_tensor,
    native_reduce_scatter,
)

from .kernels import Kernel
from .layout import chunk_ids, chunk_positions, to_sequence_order


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 (rank order)."""
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_tensor(out, x, group=group)
    return out


def _reduce_scatter_seq(x: torch.Tensor, group, native: bool | None) -> torch.Tensor:
    """Sum over the group, keep this rank's block of dim 0."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    if native_reduce_scatter(group, native):
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        _reduce_scatter_tensor(out, x, group=group)
        return out
    dist.all_reduce(x, group=group)  # gloo: all-reduce + slice is the faster way
    return x.chunk(world, dim=0)[dist.get_rank(group)].contiguous()


def _local_attention(q, kv_gathered, n_kv: int, cp_rank: int, cp: int, kernel: Kernel):
    """Both local query chunks against the gathered keys and values up to their end."""
    k_all, v_all = to_sequence_order(kv_gathered, cp).split([n_kv, n_kv], dim=2)
    c = q.shape[0] // 2
    outs = []
    for half, chunk in enumerate(chunk_ids(cp_rank, cp)):
        end = (chunk + 1) * c
        q_index = chunk_positions(chunk, c, q.device)
        k_index = torch.arange(end, device=q.device)
        outs.append(
            kernel(q[half * c : (half + 1) * c], k_all[:end], v_all[:end], q_index, k_index)
        )
    return torch.cat(outs)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, kernel, native):
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.save_for_backward(q, k, v)  # local only: the gathered K/V are not kept
        ctx.group, ctx.kernel, ctx.native, ctx.cp, ctx.cp_rank = group, kernel, native, cp, cp_rank
        kv = _gather_seq(torch.cat((k, v), dim=2), group)  # one collective for K and V
        return _local_attention(q, kv, k.shape[2], cp_rank, cp, kernel)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        n_kv = k.shape[2]
        kv = _gather_seq(torch.cat((k, v), dim=2), ctx.group).requires_grad_()
        q = q.detach().requires_grad_()
        with torch.enable_grad():
            out = _local_attention(q, kv, n_kv, ctx.cp_rank, ctx.cp, ctx.kernel)
        grad_q, grad_kv = torch.autograd.grad(out, (q, kv), grad_out)
        # Every rank's queries read every owner's keys: sum their gradients at the owner.
        grad_k, grad_v = _reduce_scatter_seq(grad_kv, ctx.group, ctx.native).split(
            [n_kv, n_kv], dim=2
        )
        return grad_q, grad_k, grad_v, None, None, None


def allgather_attention(q, k, v, group, kernel: Kernel, native: bool | None = None):
    """Causal attention of this cp rank's q [2C, b, h, d] over the whole sequence, its K/V
    all-gathered over `group`. `native`: see tensor_parallel.functional.native_reduce_scatter."""
    return _AllGatherAttention.apply(q, k, v, group, kernel, native)
