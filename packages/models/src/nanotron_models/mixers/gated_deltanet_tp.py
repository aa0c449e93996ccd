"""Tensor parallelism for the Gated DeltaNet mixer, as index maps over full tensors.

Rank r of tp keeps key heads [r*H_k/tp, (r+1)*H_k/tp) and the value heads they serve (value
head i reads key head i // (H_v/H_k), so a rank's value heads are [r*H_v/tp, (r+1)*H_v/tp)).
in_proj_qkvz's and in_proj_ba's rows are laid out per key head ([q k v z] and [b a] of key
head 0, then of key head 1, ...): a rank's rows are ONE contiguous block of each, a plain
column-parallel split. The conv's channels are [q | k | v] of all heads: a rank keeps its
slice of each section, so its local conv has the same layout at the local sizes
(`GatedDeltaNetDims.tp_local`). A_log and dt_bias split by value head; the gated norm's weight
[d_v] is shared by the heads, so every rank holds all of it and its gradient is the SUM of the
tp ranks' (each sees only its heads: reduce it over tp, as a sequence-parallel norm's);
out_proj is row-parallel (its input columns split by value head; no bias).

`GATED_DELTANET_TP_PLAN` says, per parameter, the dimension split and the full indices a rank
keeps: building (shard_gated_deltanet), gathering (unshard_gated_deltanet) and initialisation
read the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .gated_deltanet import GatedDeltaNetDims
from .mamba2_tp import _block, _sections

Tensor = torch.Tensor
IndexFn = Callable[[GatedDeltaNetDims, int, int], Tensor]


def conv_channels(dims: GatedDeltaNetDims, tp: int, rank: int) -> Tensor:
    """Indices of the full conv channels [q | k | v] that rank keeps, in its local order."""
    return _sections([dims.key_dim, dims.key_dim, dims.value_dim], tp, rank)


def qkvz_rows(dims: GatedDeltaNetDims, tp: int, rank: int) -> Tensor:
    return _block(dims.qkvz_size, tp, rank)


def ba_rows(dims: GatedDeltaNetDims, tp: int, rank: int) -> Tensor:
    return _block(2 * dims.num_value_heads, tp, rank)


def value_heads(dims: GatedDeltaNetDims, tp: int, rank: int) -> Tensor:
    return _block(dims.num_value_heads, tp, rank)


def value_channels(dims: GatedDeltaNetDims, tp: int, rank: int) -> Tensor:
    return _block(dims.value_dim, tp, rank)


# name -> (split dimension, indices kept); absent names (norm.weight) are replicated
GATED_DELTANET_TP_PLAN: dict[str, tuple[int, IndexFn]] = {
    "in_proj_qkvz.weight": (0, qkvz_rows),
    "in_proj_ba.weight": (0, ba_rows),
    "conv1d.weight": (0, conv_channels),
    "dt_bias": (0, value_heads),
    "A_log": (0, value_heads),
    "out_proj.weight": (1, value_channels),
}


def shard_gated_deltanet(
    full: Mapping[str, Tensor], dims: GatedDeltaNetDims, tp: int, rank: int
) -> dict[str, Tensor]:
    """Rank `rank`'s tensors from a full mixer's state dict (names relative to the mixer), for
    a mixer built with `dims.tp_local(tp)`."""
    dims.tp_local(tp)  # the one-line refusal of heads that tp does not divide
    local = {}
    for name, tensor in full.items():
        if name in GATED_DELTANET_TP_PLAN:
            dim, index = GATED_DELTANET_TP_PLAN[name]
            tensor = tensor.index_select(dim, index(dims, tp, rank).to(tensor.device))
        local[name] = tensor
    return local


def unshard_gated_deltanet(
    shards: Sequence[Mapping[str, Tensor]], dims: GatedDeltaNetDims
) -> dict[str, Tensor]:
    """The full state dict from every rank's shard (in rank order): shard_gated_deltanet's
    inverse."""
    tp = len(shards)
    dims.tp_local(tp)
    full = {}
    for name, first in shards[0].items():
        if name not in GATED_DELTANET_TP_PLAN:
            full[name] = first
            continue
        dim, index = GATED_DELTANET_TP_PLAN[name]
        shape = list(first.shape)
        shape[dim] *= tp
        out = first.new_empty(shape)
        for rank, shard in enumerate(shards):
            out.index_copy_(dim, index(dims, tp, rank).to(out.device), shard[name])
        full[name] = out
    return full
