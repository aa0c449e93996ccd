"""What each layer of Qwen3-Next hands to the tp and cp groups: the planner's communication
model (nanotron_train/plan/comm.py), through the family row's `layer_comm`."""

from __future__ import annotations

import torch

from ..mamba2_hybrid.comm import state_passing_bytes
from ..mixers.gated_deltanet_cp import cp_bytes_per_layer
from .config import Qwen3NextConfig
from .layers import gdn_dims


def qwen3_next_layer_comm(
    config: Qwen3NextConfig, tp: int, cp: int, cp_rank: int, batch: int, dtype: torch.dtype
) -> tuple[tuple[int, int | None], ...]:
    """Per layer (tp blocks: the mixer's and the feed-forward's; cp payload per micro-batch:
    a Gated DeltaNet layer's state passing, None for the gated attention)."""
    g = 0
    if cp > 1:
        dims = gdn_dims(config).tp_local(tp)
        g = state_passing_bytes(cp_bytes_per_layer, batch, cp, cp_rank, dims, dtype)
    return tuple(
        (2, g if config.mixer_kind(i) == "G" else None) for i in range(config.num_hidden_layers)
    )
