"""Passing a sequence mixer's state across the cp ranks (state-space, linear-attention layers).

Attention reaches other ranks' keys and values; a mixer that carries a state along the
sequence instead needs, for each chunk it holds, a summary of everything before it. Two
differentiable exchanges over the chunk layout, each beside its backward twin:

- `pass_tails(tails, group)`: chunk j receives the tail of chunk j-1 (e.g. the conv's last
  K-1 inputs), zeros for chunk 0. p2p to the owner of the next chunk, batched; when that
  chunk is on the same rank (zigzag: chunks cp-1 and cp) it is a local copy. Backward: the
  same exchange the other way (chunk j-1's tail gradient comes from chunk j's owner).
- `gather_summaries(summary, group)`: every chunk's summary (e.g. its state from zero and its
  total decay), all-gathered and put in sequence order, so that each rank can combine them.
  Backward: a reduce-scatter (each rank's summaries were read by every rank).

`ChunkLayout` says which chunks (of equal length) each rank holds, in its local order; the
default is the load-balanced layout of layout.py (rank r: chunks r and 2cp-1-r). Nothing
here assumes that layout beyond "each rank holds the same number of chunks".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from nanotron_parallel.compile_boundary import eager_under_compile
from nanotron_parallel.tensor_parallel.functional import (
    _all_gather_tensor,
    _reduce_scatter_tensor,
    native_reduce_scatter,
)

from .layout import chunk_ids

_TAIL_TAG = 32  # + the receiving chunk's index: unique per message, whatever the layout


@dataclass(frozen=True)
class ChunkLayout:
    """`ranks[r]`: the chunks (indices in sequence order) cp rank r holds, in local order."""

    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def zigzag(cls, cp: int) -> ChunkLayout:
        """The layout attention uses (layout.py)."""
        return cls(tuple(chunk_ids(r, cp) for r in range(cp)))

    def __post_init__(self) -> None:
        flat = sorted(c for chunks in self.ranks for c in chunks)
        if flat != list(range(len(flat))) or len({len(c) for c in self.ranks}) != 1:
            raise ValueError(f"ChunkLayout {self.ranks}: every chunk once, as many per rank")

    @property
    def per_rank(self) -> int:
        return len(self.ranks[0])

    @property
    def num_chunks(self) -> int:
        return len(self.ranks) * self.per_rank

    @cached_property
    def owners(self) -> dict[int, tuple[int, int]]:
        """chunk -> (rank, index in that rank's local order)."""
        return {c: (r, i) for r, chunks in enumerate(self.ranks) for i, c in enumerate(chunks)}

    @cached_property
    def sequence_order(self) -> tuple[int, ...]:
        """Positions in the rank-order concatenation [cp * per_rank] of chunks 0, 1, ..."""
        return tuple(r * self.per_rank + i for r, i in map(self.owners.get, range(self.num_chunks)))

    @cached_property
    def rank_order(self) -> tuple[int, ...]:
        """The inverse: the chunk at each position of the rank-order concatenation."""
        return tuple(c for chunks in self.ranks for c in chunks)

    def split(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank `rank`'s chunks of a whole-sequence `x` along `dim`, in its local order (for
        the zigzag layout: layout.split_sequence)."""
        c = x.shape[dim] // self.num_chunks
        return torch.cat([x.narrow(dim, chunk * c, c) for chunk in self.ranks[rank]], dim=dim)

    def tails_received(self, rank: int, backward: bool = False) -> list[int]:
        """This rank's chunks whose predecessor (backward: successor) is on another rank: the
        messages it receives in `pass_tails` (in its backward)."""
        step = 1 if backward else -1
        return [
            c
            for c in self.ranks[rank]
            if 0 <= c + step < self.num_chunks and self.owners[c + step][0] != rank
        ]


# ---- tails: chunk j-1 -> chunk j ------------------------------------------------------------


def _shift(x: torch.Tensor, group, layout: ChunkLayout, step: int) -> torch.Tensor:
    """out[i] (this rank's chunk j) = x of chunk j - step (zeros where that is no chunk).
    x, out: [per_rank, ...]. step=+1: from the predecessor; -1: from the successor."""
    rank = dist.get_rank(group)
    world = group if group is not None else dist.group.WORLD
    x = x.contiguous()  # p2p sends and receives whole, contiguous buffers
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    sends, recvs = [], []
    for i, chunk in enumerate(layout.ranks[rank]):
        target = chunk + step
        if 0 <= target < layout.num_chunks:
            owner, local = layout.owners[target]
            if owner == rank:
                out[local] = x[i]
            else:
                sends.append((target, x[i], dist.get_global_rank(world, owner)))
        source = chunk - step
        if 0 <= source < layout.num_chunks and layout.owners[source][0] != rank:
            peer = dist.get_global_rank(world, layout.owners[source][0])
            recvs.append((chunk, out[i], peer))
    # Both sides list a pair's messages by the receiving chunk: NCCL matches them in order.
    ops = [
        dist.P2POp(dist.isend, t, p, group, _TAIL_TAG + c) for c, t, p in sorted(sends, key=_first)
    ]
    ops += [
        dist.P2POp(dist.irecv, t, p, group, _TAIL_TAG + c) for c, t, p in sorted(recvs, key=_first)
    ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


def _first(item: tuple) -> int:
    return item[0]


class _PassTails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tails, group, layout):
        ctx.group, ctx.layout = group, layout
        return _shift(tails, group, layout, +1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.group, ctx.layout, -1), None, None


@eager_under_compile  # p2p in an autograd function: a graph break when compiled
def pass_tails(
    tails: torch.Tensor, group: dist.ProcessGroup | None, layout: ChunkLayout | None = None
) -> torch.Tensor:
    """tails [per_rank, ...]: this rank's chunks' tails, local order -> [per_rank, ...]: for
    each of its chunks, the tail of the chunk before it in the sequence (zeros for chunk 0)."""
    layout = layout or ChunkLayout.zigzag(dist.get_world_size(group))
    return _PassTails.apply(tails, group, layout)


# ---- summaries: all-gather in sequence order ----------------------------------------------


def _permute(x: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """x[order] along dim 0, by slices: no index tensor to copy to the device each call."""
    return torch.cat([x[i : i + 1] for i in order])


class _GatherSummaries(torch.autograd.Function):
    @staticmethod
    def forward(ctx, summary, group, layout, native):
        ctx.group, ctx.layout, ctx.native = group, layout, native
        summary = summary.contiguous()
        out = summary.new_empty((dist.get_world_size(group) * summary.shape[0], *summary.shape[1:]))
        _all_gather_tensor(out, summary, group=group)
        return _permute(out, layout.sequence_order)

    @staticmethod
    def backward(ctx, grad):
        group, layout = ctx.group, ctx.layout
        by_rank = _permute(grad, layout.rank_order)
        world = dist.get_world_size(group)
        if native_reduce_scatter(group, ctx.native):
            out = by_rank.new_empty((by_rank.shape[0] // world, *by_rank.shape[1:]))
            _reduce_scatter_tensor(out, by_rank, group=group)
            return out, None, None, None
        dist.all_reduce(by_rank, group=group)  # gloo: all-reduce + slice
        return by_rank.chunk(world)[dist.get_rank(group)].contiguous(), None, None, None


@eager_under_compile  # a collective in an autograd function: a graph break when compiled
def gather_summaries(
    summary: torch.Tensor,
    group: dist.ProcessGroup | None,
    layout: ChunkLayout | None = None,
    native: bool | None = None,
) -> torch.Tensor:
    """summary [per_rank, ...] (this rank's chunks, local order) -> [num_chunks, ...] every
    chunk's, in sequence order. `native`: the backward's reduce-scatter
    (tensor_parallel.functional.native_reduce_scatter; None: native under NCCL only)."""
    layout = layout or ChunkLayout.zigzag(dist.get_world_size(group))
    return _GatherSummaries.apply(summary, group, layout, native)
