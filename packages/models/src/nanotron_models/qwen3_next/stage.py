"""Qwen3NextStage: some contiguous decoder layers of a Qwen3-Next model with this rank's tp
shards (a stage.ModelStage), and its builder, the family row's `build_stage`.

It is the Mamba-2 hybrid's stage (mamba2_hybrid/stage.py: composition, fused loss, recompute,
compile, decoding, logits) with Qwen3-Next's layers, its zero-centred final norm, one rotary
table for the attention layers, and the MoE dispatcher. Documents: with document masking on,
each micro-batch's document ids give the attention masks and, once per micro-batch, the
Gated DeltaNet layers' reset mask (state and conv start again at each document).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanotron_parallel.tensor_parallel import TensorParallelLinearMode

from ..blocks import Embedding, LMHead, Loss, linear_mode
from ..config import ModelConfigError
from ..mamba2_hybrid.decode_state import HybridDecodeState
from ..mamba2_hybrid.layers import RESET_KEY
from ..mamba2_hybrid.stage import HybridStage, attention_backend, prepare_build, refuse_mup
from ..masks import DOCUMENT_IDS_KEY
from ..materialise import materialise
from ..mixers import reset_mask_from_document_ids
from ..rotary import RotaryTable
from .attention import ZeroCentredRMSNorm
from .config import Qwen3NextConfig
from .layers import Qwen3NextLayer
from .spec import fill_head_params, qwen3_next_block_names, qwen3_next_init_spec

Batch = dict[str, torch.Tensor]


class Qwen3NextStage(HybridStage):
    """Submodules `embedding`, `decoder` (ModuleDict by global layer index), `final_norm`,
    `lm_head`, `loss`, each only if in block_names."""

    def __init__(self, config: Qwen3NextConfig, pc, block_names, tp_mode, backend, device,
                 dtype, dispatcher=None):  # fmt: skip
        nn.Module.__init__(self)
        self.config, self.pc, self.block_names = config, pc, list(block_names)
        self.tp_mode, group, c = tp_mode, pc.tp_group, config
        vpad, kw = c.padded_vocab_size(pc.tp_size), {"device": device, "dtype": dtype}
        if "embedding" in block_names:
            self.embedding = Embedding(vpad, c.hidden_size, group, tp_mode, **kw)
            self.embedding.fuse_grad_accumulation = not c.tie_word_embeddings
        rotary = RotaryTable(c.rotary_dim, c.rope_theta)
        layers = [int(n.split(".")[1]) for n in block_names if n.startswith("decoder.")]
        self.decoder = nn.ModuleDict({
            str(i): Qwen3NextLayer(c, i, group, tp_mode, backend, rotary, **kw,
                                   dispatcher=dispatcher)
            for i in layers
        })  # fmt: skip
        if "final_norm" in block_names:
            sp = tp_mode == TensorParallelLinearMode.REDUCE_SCATTER
            eps, fused = c.rms_norm_eps, c._fused_rms_norm
            self.final_norm = ZeroCentredRMSNorm(c.hidden_size, eps, group, sp, fused=fused, **kw)
        if "lm_head" in block_names:
            self.lm_head = LMHead(c.hidden_size, vpad, group, tp_mode, **kw)
            self.lm_head.fuse_grad_accumulation = not c.tie_word_embeddings
        if "loss" in block_names:
            self.loss = Loss(c.vocab_size, group, c.z_loss_weight)
        self.recompute, self.cp_size = False, 1
        self._compiled: dict = {}
        self.fused_loss = False
        self.set_fused_loss(True)

    def set_context_parallel(self, group, size: int, native_reduce_scatter=None, attention=None):
        """Train on 1/cp of every sequence (nanotron_parallel.context_parallel's zigzag
        chunks): attention layers reach the other cp ranks' keys and values by `attention`,
        Gated DeltaNet layers pass their conv halo and state maps across ranks
        (mixers/gated_deltanet_cp.py), which needs ALL_REDUCE (their batch-first projections
        cannot gather a sequence-parallel input)."""
        has_g = any(layer.kind == "G" for layer in self.decoder.values())
        if size > 1 and has_g and self.tp_mode == TensorParallelLinearMode.REDUCE_SCATTER:
            raise ModelConfigError(
                "parallelism.tp_mode REDUCE_SCATTER with context_parallel_size > 1 is not "
                "supported for Gated DeltaNet layers: use ALL_REDUCE"
            )
        for layer in self.decoder.values():
            layer.set_context_parallel(group, size, native_reduce_scatter, attention)
        self.cp_size = size
        if hasattr(self, "loss"):
            self.loss.cp_size = size

    def prepared(self, batch: Batch) -> Batch:
        """The batch with the document ids (when masking) and the Gated DeltaNet reset mask:
        made once per micro-batch, not per layer."""
        if not self.config.document_masking or batch.get("position_ids") is None:
            return batch
        out = super().prepared(batch)
        if self.cp_size == 1 and any(layer.kind == "G" for layer in self.decoder.values()):
            out[RESET_KEY] = reset_mask_from_document_ids(out[DOCUMENT_IDS_KEY])
        return out


class Qwen3NextDecodeState(HybridDecodeState):
    """The KV cache of the attention layers and each Gated DeltaNet layer's conv window and
    delta-rule state (`ssm`: GatedDeltaNetState by layer)."""

    def nbytes(self) -> int:
        states = sum(s.conv.nbytes + s.recurrent.nbytes for s in self.ssm.values())
        kv = sum(t.nbytes for d in (self.kv.keys, self.kv.values) for t in d.values())
        return states + kv


def new_qwen3_next_decode_state(config: Qwen3NextConfig) -> Qwen3NextDecodeState:
    return Qwen3NextDecodeState()


def build_qwen3_next_stage(
    config: Qwen3NextConfig,
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
    parametrization: Any = "sp",
    dispatcher=None,
) -> Qwen3NextStage:
    """The named contiguous blocks with this rank's tp shards, initialised from `seed` (the
    same full weights whatever the layout); `dispatcher`: how sparse layers reach their
    experts (nanotron_parallel.expert_parallel; None: every expert on this rank)."""
    refuse_mup(parametrization, "Qwen3-Next")
    std, device = prepare_build(config, pc, block_names, qwen3_next_block_names(config),
                                init_std, device)  # fmt: skip
    backend = attention_backend(config, attn_backend)
    stage = Qwen3NextStage(config, pc, block_names, linear_mode(tp_mode), backend, "meta", dtype,
                           dispatcher)  # fmt: skip
    materialise(stage, config, qwen3_next_init_spec, pc.tp_rank, pc.tp_size, seed, std, device,
                dtype, scaling_method, parametrization)  # fmt: skip
    fill_head_params(stage, config, seed)
    return stage
