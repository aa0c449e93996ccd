"""Mamba1Stage: some contiguous blocks of a Mamba-1 model with this rank's tp shards (a
stage.ModelStage), and its builder, the family row's `build_stage`.

It is the Mamba-2 family's HybridStage (composition, documents, decoding, pipelined decoding
are the same for any stack of state-space layers) with Mamba-1 layers and a final norm that
reads an fp32 residual stream. HybridStage builds its own layers, so the embedding, lm_head and
loss come from it and the layers and final norm from here; its forward and decoding recognise
a layer as a HybridLayer, which Mamba1Layer is through `_StateSpaceLayer`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from nanotron_parallel.tensor_parallel import TensorParallelLinearMode

from ..blocks import linear_mode
from ..mamba2_hybrid.decode_state import HybridDecodeState
from ..mamba2_hybrid.layers import HybridLayer
from ..mamba2_hybrid.stage import HybridStage, prepare_build
from ..materialise import materialise
from .config import MambaConfig
from .layers import CastRMSNorm, Mamba1Layer
from .spec import fill_special_params, mamba1_block_names, mamba1_init_spec


class _StateSpaceLayer(Mamba1Layer, HybridLayer):
    """A Mamba-1 layer that HybridStage's forward, recompute and decoding treat as one of its
    layers (it is called the same way); built by Mamba1Layer's constructor only."""

    def __init__(self, *args, **kwargs) -> None:
        Mamba1Layer.__init__(self, *args, **kwargs)

    forward = Mamba1Layer.forward


class Mamba1Stage(HybridStage):
    """Submodules `embedding`, `decoder` (ModuleDict by global layer index of Mamba-1 layers),
    `final_norm`, `lm_head`, `loss`, each only if in block_names."""

    def __init__(self, config: MambaConfig, pc, block_names, tp_mode, backend, device, dtype):
        outer = [n for n in block_names if n in ("embedding", "lm_head", "loss")]
        super().__init__(config, pc, outer, tp_mode, backend, device, dtype)
        self.block_names = list(block_names)
        group, kw = pc.tp_group, {"device": device, "dtype": dtype}
        layers = [int(n.split(".")[1]) for n in block_names if n.startswith("decoder.")]
        self.decoder = nn.ModuleDict(
            {str(i): _StateSpaceLayer(config, i, group, tp_mode, backend, **kw) for i in layers}
        )
        if "final_norm" in block_names:
            sp = tp_mode == TensorParallelLinearMode.REDUCE_SCATTER
            eps, fused = config.rms_norm_eps, config._fused_rms_norm
            self.final_norm = CastRMSNorm(config.d_model, eps, group, sp, fused=fused, **kw)
        self.set_fused_loss(True)


def build_mamba1_stage(
    config: MambaConfig,
    pc,
    block_names: list[str],
    *,
    tp_mode=TensorParallelLinearMode.ALL_REDUCE,
    seed: int = 42,
    init_std: float | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
    attn_backend: str | None = None,
    scaling_method: str = "NUM_LAYERS",
    residuals_per_layer: int = 1,
) -> Mamba1Stage:
    """The named contiguous blocks with this rank's tp shards, initialised from `seed` (the
    same full weights whatever the layout). `init_std`: the embedding's (Nanotron's
    init_method.initializer_range); `scaling_method` NUM_LAYERS divides out_proj by
    sqrt(residuals_per_layer * layers) (its rescale_prenorm_residual, n_residuals_per_layer)."""
    std, device = prepare_build(config, pc, block_names, mamba1_block_names(config), init_std,
                                device)  # fmt: skip
    stage = Mamba1Stage(config, pc, block_names, linear_mode(tp_mode), "auto", "meta", dtype)
    spec = functools.partial(mamba1_init_spec, residuals_per_layer=residuals_per_layer)
    materialise(stage, config, spec, pc.tp_rank, pc.tp_size, seed, std, device, dtype,
                scaling_method)  # fmt: skip
    fill_special_params(stage, config, seed)
    return stage


def new_mamba1_decode_state(config: Any):
    """Decoding state: each layer's conv window and SSM state (HybridStage's)."""
    return HybridDecodeState()
