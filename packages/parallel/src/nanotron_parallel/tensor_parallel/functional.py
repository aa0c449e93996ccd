"""Differentiable tensor-parallel collectives: each forward collective has its adjoint backward.

Gloo (the CPU backend) may lack a native reduce-scatter, so there it is an all-reduce followed
by taking this rank's chunk: the same sums, exactly, just more traffic. NCCL uses the native op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from nanotron_parallel.grid import ParallelConfigError
from nanotron_parallel.phase_timer import comm_span

Group = dist.ProcessGroup | None

# Newer torch names the tensor-in/tensor-out collectives "*_single"; older ones only have these.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _world(group: Group) -> int:
    return dist.get_world_size(group)


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> None:
    size = x.shape[dim]
    if size % world != 0:
        raise ParallelConfigError(
            f"{what}: size {size} of dim {dim} (shape {tuple(x.shape)}) is not divisible by "
            f"the tensor-parallel size {world}; every rank needs an equal chunk"
        )


def all_reduce_(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce `x` in place over `group` (nothing to do for a group of one); returns `x`."""
    if _world(group) > 1:
        with record_function("tp.all_reduce"), comm_span("tp_comm"):
            dist.all_reduce(x, op=op, group=group)
    return x


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Out-of-place all-reduce for the autograd functions (their input must not change)."""
    if _world(group) == 1:
        return x
    return all_reduce_(x.contiguous().clone(), group)


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "split across tp")
    return x.chunk(world, dim=dim)[dist.get_rank(group)].clone(
        memory_format=torch.contiguous_format
    )


def _all_gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    # Gather along dim 0 of a permuted copy: concatenation commutes with the permutation.
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    with record_function("tp.all_gather"), comm_span("tp_comm"):
        _all_gather_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def native_reduce_scatter(group: Group, native: bool | None) -> bool:
    """Whether to run the backend's reduce-scatter (`native=None`: under NCCL only; gloo's
    all-reduce + slice is faster there, and tests force the NCCL path with `native=True`)."""
    return dist.get_backend(group) == "nccl" if native is None else native


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int, native: bool | None) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "reduce-scatter across tp")
    moved = x.movedim(dim, 0).contiguous()
    if native_reduce_scatter(group, native):
        out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
        with record_function("tp.reduce_scatter"), comm_span("tp_comm"):
            _reduce_scatter_tensor(out, moved, group=group)
    else:
        summed = moved.clone()
        with record_function("tp.reduce_scatter"), comm_span("tp_comm"):
            dist.all_reduce(summed, group=group)
        out = summed.chunk(world, dim=0)[dist.get_rank(group)]
    return out.movedim(0, dim).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = _all_reduce(x, group)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        out = _split(x, group, dim)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        out = _all_gather(x, group, dim)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


class _AllGatherToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, native):
        ctx.group, ctx.dim, ctx.native = group, dim, native
        out = _all_gather(x, group, dim)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim, ctx.native), None, None, None


class _ReduceScatterFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, native):
        ctx.group, ctx.dim = group, dim
        out = _reduce_scatter(x, group, dim, native)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None, None


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ParallelConfigError(f"dim={dim} is out of range for a {x.dim()}-d tensor")
    return dim % x.dim()


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (enter a tp region with a replicated input).
    A group of one adds no autograd node (the step's forward and backward run every call)."""
    return x if _world(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward (sum the partial results of a tp region); identity backward. A group
    of one adds no autograd node."""
    return x if _world(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of ``dim``; all-gather of the gradient."""
    return _ScatterToTP.apply(x, group, _norm_dim(x, dim))


def gather_from_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim``; backward keeps this rank's chunk of the gradient."""
    return _GatherFromTP.apply(x, group, _norm_dim(x, dim))


def all_gather_to_tp(
    x: torch.Tensor, group: Group, dim: int = 0, native: bool | None = None
) -> torch.Tensor:
    """All-gather along ``dim`` (sequence parallel -> tp region); reduce-scatter gradient
    (``native``: see `native_reduce_scatter`)."""
    return _AllGatherToTP.apply(x, group, _norm_dim(x, dim), native)


def reduce_scatter_from_tp(
    x: torch.Tensor, group: Group, dim: int = 0, native: bool | None = None
) -> torch.Tensor:
    """Sum over tp and keep this rank's chunk of ``dim``; all-gather of the gradient
    (``native``: see `native_reduce_scatter`)."""
    return _ReduceScatterFromTP.apply(x, group, _norm_dim(x, dim), native)
