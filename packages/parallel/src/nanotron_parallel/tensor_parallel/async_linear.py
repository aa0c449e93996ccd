"""Sequence-parallel linears whose communication overlaps their matmuls (REDUCE_SCATTER mode).

`tp_linear_async_communication: true` swaps the synchronous collective-then-matmul of the
column- and row-parallel linears for these autograd functions:

- column forward: start the all-gather of the sequence-sharded input, compute this rank's own
  sequence chunk of the output while the other chunks travel, then the rest;
- column backward: start the reduce-scatter of the input gradient, compute the weight
  gradient while it runs;
- row backward: start the all-gather of the output gradient, compute this rank's own chunk of
  the input and weight gradients while the other chunks travel, then the rest.

The sums are the same as the synchronous path's, only split by sequence chunk, so results agree
to fp32 rounding. Collectives use `async_op=True`, which gloo (a background thread) and NCCL (a
side stream) both run while the host keeps computing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from nanotron_parallel.phase_timer import comm_span
from nanotron_parallel.tensor_parallel.functional import (
    _all_gather_tensor,
    _reduce_scatter_tensor,
    native_reduce_scatter,
)
from nanotron_parallel.tensor_parallel.weight_grad import defer, linear_weight_grads

Group = dist.ProcessGroup | None


def _wait(handle: dist.Work) -> None:
    """Wait for an async collective; what is left of it after the overlap is tp time."""
    with comm_span("tp_comm"):
        handle.wait()


def _start_all_gather(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, dist.Work]:
    """Begin gathering dim 0 of `x` from every tp rank; returns (buffer, handle)."""
    x = x.contiguous()
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    return out, _all_gather_tensor(out, x, group=group, async_op=True)


def _start_reduce_scatter(x: torch.Tensor, group: Group, native: bool | None):
    """Begin summing `x` over tp, keeping this rank's chunk of dim 0. Returns a function that
    waits and gives the chunk (on gloo, unless forced, all-reduce then slice: faster there)."""
    x = x.contiguous()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if native_reduce_scatter(group, native):
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        handle = _reduce_scatter_tensor(out, x, group=group, async_op=True)
        return lambda: (_wait(handle), out)[1]
    handle = dist.all_reduce(x, group=group, async_op=True)
    return lambda: (_wait(handle), x.chunk(world, dim=0)[rank].contiguous())[1]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AsyncColumnLinear(torch.autograd.Function):
    """y = all_gather_seq(x) W^T + b, gathering while computing."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, native, recompute_allgather=False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        with record_function("tp.all_gather.async"):
            full, handle = _start_all_gather(x, group)
        own = F.linear(x, weight, bias)  # overlaps the gather
        _wait(handle)
        n = x.shape[0]
        parts = [
            own if j == rank else F.linear(full[j * n : (j + 1) * n], weight, bias)
            for j in range(world)
        ]
        ctx.group, ctx.has_bias, ctx.native, ctx.bias = group, bias is not None, native, bias
        ctx.weight = weight  # the parameter itself, for a deferred W (weight_grad.defer)
        ctx.recompute = recompute_allgather  # keep the shard; gather it again in the backward
        ctx.save_for_backward(x if recompute_allgather else full, weight)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad_y):
        saved, weight = ctx.saved_tensors
        want_w = ctx.needs_input_grad[1]
        has_bias = ctx.has_bias and ctx.needs_input_grad[2]
        params = (ctx.weight, ctx.bias) if has_bias else (ctx.weight,)
        group, recompute = ctx.group, ctx.recompute

        def compute():  # deferred (a W): gathers the input again itself if it kept the shard
            full = _all_gather_wait(saved, group) if recompute else saved
            return linear_weight_grads(grad_y, full, weight, has_bias)

        deferred = want_w and defer(params, compute)
        full_handle = None
        if recompute and want_w and not deferred:
            with record_function("tp.all_gather.async"):
                full_handle = _start_all_gather(saved, group)
        full = saved
        grad_x = grad_w = grad_b = None
        finish = None
        if ctx.needs_input_grad[0]:
            with record_function("tp.reduce_scatter.async"):
                finish = _start_reduce_scatter(grad_y.matmul(weight), group, ctx.native)
        if want_w and not deferred:  # overlaps the reduce-scatter
            if full_handle is not None:
                full, handle = full_handle
                _wait(handle)
            grad_w, grad_b = linear_weight_grads(grad_y, full, weight, has_bias)
        if finish is not None:
            grad_x = finish()
        return grad_x, grad_w, grad_b, None, None, None


def _all_gather_wait(x: torch.Tensor, group: Group) -> torch.Tensor:
    full, handle = _start_all_gather(x, group)
    _wait(handle)
    return full


class _AsyncRowLinear(torch.autograd.Function):
    """reduce_scatter_seq(x W^T); the backward gathers the gradient while computing."""

    @staticmethod
    def forward(ctx, x, weight, group, native):
        with record_function("tp.reduce_scatter"):
            out = _start_reduce_scatter(F.linear(x, weight), group, native)()
        ctx.group, ctx.weight = group, weight  # the parameter itself, for a deferred W
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        with record_function("tp.all_gather.async"):
            full, handle = _start_all_gather(grad_out, group)
        n = grad_out.shape[0]
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        own_x = grad_out.matmul(weight) if want_x else None  # overlaps the gather
        _wait(handle)

        def compute():  # the weight gradient chunk by chunk, summed in rank order
            grad_w = None
            for j in range(world):
                g = grad_out if j == rank else full[j * n : (j + 1) * n]
                gw = _flat(g).t().matmul(_flat(x[j * n : (j + 1) * n]))
                grad_w = gw if grad_w is None else grad_w + gw
            return (grad_w.to(weight.dtype),)

        grad_x = None
        if want_x:
            parts = [
                own_x if j == rank else full[j * n : (j + 1) * n].matmul(weight)
                for j in range(world)
            ]
            grad_x = torch.cat(parts, dim=0)
        if not want_w or defer((ctx.weight,), compute):
            return grad_x, None, None, None
        return grad_x, compute()[0], None, None


def async_column_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Group,
    native: bool | None = None,
    recompute_allgather: bool = False,
) -> torch.Tensor:
    """Column-parallel linear of a sequence-sharded input `[s/tp, b, in]` -> `[s, b, out/tp]`
    (`recompute_allgather`: keep only the shard for the backward, which gathers it again)."""
    return _AsyncColumnLinear.apply(x, weight, bias, group, native, recompute_allgather)


def async_row_linear(
    x: torch.Tensor, weight: torch.Tensor, group: Group, native: bool | None = None
) -> torch.Tensor:
    """Row-parallel linear `[s, b, in/tp]` -> reduce-scattered `[s/tp, b, out]` (no bias)."""
    if x.shape[0] % dist.get_world_size(group) != 0:
        raise ValueError(
            f"sequence length {x.shape[0]} is not divisible by tp={dist.get_world_size(group)}"
        )
    return _AsyncRowLinear.apply(x, weight, group, native)
