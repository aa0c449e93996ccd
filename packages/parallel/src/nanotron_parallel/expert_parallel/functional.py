"""The expert-parallel collectives over the ep group, each beside its backward twin.

Every one runs inside `comm_span("all_to_all")`, so the rank stats show the dispatch and
combine traffic as its own phase, forward and backward alike.

- `all_to_all(x, out_splits, in_splits, group)`: rows [sum(in_splits), ...] sent in
  contiguous runs, `in_splits[r]` to rank r, received `out_splits[r]` from rank r. Backward:
  the same exchange with the splits swapped (each gradient row goes back where its row came
  from).
- `all_gather_rows(x, group)`: [T, ...] -> [ep * T, ...] in rank order. Backward: the sum of
  every rank's gradient of this rank's rows (a reduce-scatter).
- `reduce_scatter_rows(x, group)`: [ep * T, ...] -> [T, ...], this rank's rows summed over the
  group. Backward: an all-gather. Gloo has no reduce-scatter: an all-reduce and a slice there
  (the same sums), NCCL's native one elsewhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from nanotron_parallel.conjugate import conjugate
from nanotron_parallel.phase_timer import comm_span

Group = dist.ProcessGroup | None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group):
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    with record_function("ep.all_to_all"), comm_span("all_to_all"):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = dist.get_world_size(group)
    with record_function("ep.all_gather"), comm_span("all_to_all"):
        if dist.get_backend(group) == "nccl":
            out = x.new_empty(world * x.shape[0], *x.shape[1:])
            dist.all_gather_into_tensor(out, x.contiguous(), group=group)
            return out
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = x.shape[0] // world
    with record_function("ep.reduce_scatter"), comm_span("all_to_all"):
        if dist.get_backend(group) == "nccl":
            out = x.new_empty(rows, *x.shape[1:])
            dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
            return out
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
    return total[rank * rows : (rank + 1) * rows].clone()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


_all_gather_rows = conjugate(_gather, _scatter)
_reduce_scatter_rows = conjugate(_scatter, _gather)


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group
) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def all_gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _all_gather_rows(x, group)


def reduce_scatter_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _reduce_scatter_rows(x, group)


HOST_READ = "ep.host_read"


def host_sizes(sizes: torch.Tensor) -> list[int]:
    """Row counts as Python ints: a dispatch's one device-to-host read (a sync on a GPU).
    `.tolist()` runs no profiled op, so it is named (`HOST_READ`) for the step-sync count."""
    with record_function(HOST_READ):
        return sizes.tolist()


def gather_ids(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's [T, ...] rows of a tensor without gradient (routing ids), in rank order."""
    return _gather(x, group)


def exchange_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """[ep * E_local] rows this rank sends to each global expert -> [ep * E_local] rows each
    rank sends to each of this rank's local experts (source-major). No autograd."""
    out = torch.empty_like(counts)
    with record_function("ep.counts"), comm_span("all_to_all"):
        dist.all_to_all_single(out, counts, group=group)
    return out
