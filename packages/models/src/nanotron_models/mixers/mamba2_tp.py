"""Megatron-style tensor parallelism for the Mamba-2 mixer, as index maps over full tensors.

Rank r of tp keeps heads [r*H/tp, (r+1)*H/tp) and groups [r*G/tp, (r+1)*G/tp) (a head's group
is head // (H/G), so a rank's heads read only its own groups). in_proj's output rows are
[z | x | B | C | dt] and the conv's channels [x | B | C]: a rank's rows are its slice of EACH
section, so its local in_proj has the same layout at the local sizes (`Mamba2Dims.tp_local`),
and the sections interleave over ranks rather than split in one block. out_proj is
row-parallel (its input columns split like z); its bias is added once after the all-reduce.

`MAMBA2_TP_PLAN` says, per parameter, the dimension split and the full indices a rank keeps:
building (shard_mamba2), gathering (unshard_mamba2) and initialisation read the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .mamba2 import Mamba2Dims

Tensor = torch.Tensor
IndexFn = Callable[[Mamba2Dims, int, int], Tensor]


def _block(size: int, tp: int, rank: int) -> Tensor:
    """Rank `rank`'s contiguous slice of range(size) split in tp equal blocks."""
    part = size // tp
    return torch.arange(rank * part, (rank + 1) * part)


def _sections(sizes: Sequence[int], tp: int, rank: int) -> Tensor:
    """The rank's block of each section of a dim laid out as consecutive sections."""
    parts, offset = [], 0
    for size in sizes:
        parts.append(offset + _block(size, tp, rank))
        offset += size
    return torch.cat(parts)


def conv_channels(dims: Mamba2Dims, tp: int, rank: int) -> Tensor:
    """Indices of the full conv channels [x | B | C] that rank keeps, in its local order."""
    gn = dims.n_groups * dims.state_size
    return _sections([dims.intermediate_size, gn, gn], tp, rank)


def in_proj_rows(dims: Mamba2Dims, tp: int, rank: int) -> Tensor:
    """Indices of the full in_proj rows [z | x | B | C | dt] that rank keeps, in local order."""
    gn = dims.n_groups * dims.state_size
    i = dims.intermediate_size
    return _sections([i, i, gn, gn, dims.num_heads], tp, rank)


def _heads(dims: Mamba2Dims, tp: int, rank: int) -> Tensor:
    return _block(dims.num_heads, tp, rank)


def _inner(dims: Mamba2Dims, tp: int, rank: int) -> Tensor:
    return _block(dims.intermediate_size, tp, rank)


# name -> (split dimension, indices kept); absent names are replicated
MAMBA2_TP_PLAN: dict[str, tuple[int, IndexFn]] = {
    "in_proj.weight": (0, in_proj_rows),
    "in_proj.bias": (0, in_proj_rows),
    "conv1d.weight": (0, conv_channels),
    "conv1d.bias": (0, conv_channels),
    "dt_bias": (0, _heads),
    "A_log": (0, _heads),
    "D": (0, _heads),
    "norm.weight": (0, _inner),
    "out_proj.weight": (1, _inner),
}
ROW_PARALLEL_BIAS = "out_proj.bias"  # one copy, added after the all-reduce


def _check(dims: Mamba2Dims, tp: int) -> None:
    dims.tp_local(tp)  # raises the one-line error for heads or groups not divisible by tp


def shard_mamba2(
    full: Mapping[str, Tensor], dims: Mamba2Dims, tp: int, rank: int
) -> dict[str, Tensor]:
    """Rank `rank`'s tensors from a full mixer's state dict (names relative to the mixer), for
    a mixer built with `dims.tp_local(tp)`. At tp > 1 out_proj's bias is left out: the
    row-parallel layer adds it once, after summing the ranks' partial outputs."""
    _check(dims, tp)
    local = {}
    for name, tensor in full.items():
        if name == ROW_PARALLEL_BIAS and tp > 1:
            continue
        if name in MAMBA2_TP_PLAN:
            dim, index = MAMBA2_TP_PLAN[name]
            tensor = tensor.index_select(dim, index(dims, tp, rank).to(tensor.device))
        local[name] = tensor
    return local


def unshard_mamba2(
    shards: Sequence[Mapping[str, Tensor]], dims: Mamba2Dims, out_proj_bias: Tensor | None = None
) -> dict[str, Tensor]:
    """The full state dict from every rank's shard (in rank order): shard_mamba2's inverse."""
    tp = len(shards)
    _check(dims, tp)
    full = {}
    for name, first in shards[0].items():
        if name not in MAMBA2_TP_PLAN:
            full[name] = first
            continue
        dim, index = MAMBA2_TP_PLAN[name]
        shape = list(first.shape)
        shape[dim] *= tp
        out = first.new_empty(shape)
        for rank, shard in enumerate(shards):
            out.index_copy_(dim, index(dims, tp, rank).to(out.device), shard[name])
        full[name] = out
    if out_proj_bias is not None:
        full[ROW_PARALLEL_BIAS] = out_proj_bias
    return full
