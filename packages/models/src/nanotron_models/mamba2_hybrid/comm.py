"""What each layer of a Mamba-2 hybrid hands to the tp and cp groups: the planner's
communication model (nanotron_train/plan/comm.py), through the family row's `layer_comm`."""

from __future__ import annotations

import torch

from ..mixers.mamba2_cp import cp_bytes_per_layer
from .config import Mamba2HybridConfig


def state_passing_bytes(cp_bytes, batch: int, cp: int, cp_rank: int, dims, dtype) -> int:
    """One state-passing layer's payload per micro-batch on `cp_rank`: the conv halo sent
    each way (p2p) and the chunk summaries all-gathered forward and reduced backward (the
    whole gathered tensor each: `cp_bytes(...)` gives the others' share, (cp - 1) / cp)."""
    fwd = cp_bytes(dims, batch, cp_rank, cp, dtype)
    bwd = cp_bytes(dims, batch, cp_rank, cp, dtype, backward=True)
    return fwd.halo + bwd.halo + 2 * fwd.states * cp // (cp - 1)


def hybrid_layer_comm(
    config: Mamba2HybridConfig, tp: int, cp: int, cp_rank: int, batch: int, dtype: torch.dtype
) -> tuple[tuple[int, int | None], ...]:
    """Per layer (tp blocks: one residual block each; cp payload per micro-batch: a Mamba-2
    layer's state passing, None for attention (the planner's cp attention), 0 for MLP and
    MoE layers)."""
    dims = config.mamba_dims.tp_local(tp)
    m = state_passing_bytes(cp_bytes_per_layer, batch, cp, cp_rank, dims, dtype) if cp > 1 else 0
    cp_of = {"M": m, "*": None}
    return tuple((1, cp_of.get(kind, 0)) for kind in config.pattern)
