"""HybridStage: some contiguous blocks of a Mamba-2 / hybrid model with this rank's tp shards
(a stage.ModelStage), and its builder, the family row's `build_stage`.

Documents: with document masking on, each micro-batch's document ids (the data's, or derived
once from positions restarting at 0) give the attention masks and, once per micro-batch, the
Mamba-2 layers' reset mask: the state and the conv start again at each document.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from nanotron_parallel.compile_boundary import prepare_compile
from nanotron_parallel.tensor_parallel import (
    TensorParallelLinearMode,
)

from ..attention import resolve_backend
from ..blocks import Embedding, LMHead, Loss, RMSNorm, linear_mode
from ..config import ATTN_BACKENDS, ModelConfigError
from ..masks import DOCUMENT_IDS_KEY, document_ids
from ..materialise import materialise
from ..mixers import (
    GatedDeltaNetMixer,
    Mamba1Mixer,
    Mamba2Mixer,
    reset_mask_from_document_ids,
)
from ..moe import MoEBlock
from ..stage_plumbing import StagePlumbing, checkpointed
from .config import Mamba2HybridConfig
from .layers import RESET_KEY, HybridLayer
from .spec import fill_head_params, hybrid_block_names, hybrid_init_spec

Batch = dict[str, torch.Tensor]


class HybridStage(StagePlumbing, nn.Module):
    """Submodules `embedding`, `decoder` (ModuleDict by global layer index), `final_norm`,
    `lm_head`, `loss`, each only if in block_names; options set after building, as
    LlamaStage's (parallelize.py calls them; the layer-independent ones in StagePlumbing),
    never renaming a parameter."""

    def __init__(
        self, config: Mamba2HybridConfig, pc, block_names, tp_mode, backend, device, dtype,
        dispatcher=None,
    ):  # fmt: skip
        super().__init__()
        self.config, self.pc, self.block_names = config, pc, list(block_names)
        self.tp_mode, group, c = tp_mode, pc.tp_group, config
        vpad, kw = c.padded_vocab_size(pc.tp_size), {"device": device, "dtype": dtype}
        if "embedding" in block_names:
            self.embedding = Embedding(vpad, c.hidden_size, group, tp_mode, **kw)
            self.embedding.fuse_grad_accumulation = not c.tie_word_embeddings
        layers = [int(n.split(".")[1]) for n in block_names if n.startswith("decoder.")]
        self.decoder = nn.ModuleDict(
            {
                str(i): HybridLayer(c, i, group, tp_mode, backend, **kw, dispatcher=dispatcher)
                for i in layers
            }  # fmt: skip
        )
        if "final_norm" in block_names:
            sp = tp_mode == TensorParallelLinearMode.REDUCE_SCATTER
            eps, fused = c.layer_norm_epsilon, c._fused_rms_norm
            self.final_norm = RMSNorm(c.hidden_size, eps, group, sp, fused=fused, **kw)
        if "lm_head" in block_names:
            self.lm_head = LMHead(c.hidden_size, vpad, group, tp_mode, **kw)
            self.lm_head.fuse_grad_accumulation = not c.tie_word_embeddings
        if "loss" in block_names:
            self.loss = Loss(c.vocab_size, group, c.z_loss_weight)
        self.recompute, self.cp_size = False, 1
        self._compiled: dict = {}
        self.fused_loss = False
        self.set_fused_loss(True)

    # ---- composition (parallelize.py) ----
    def set_context_parallel(self, group, size: int, native_reduce_scatter=None, attention=None):
        """Train on 1/cp of every sequence (nanotron_parallel.context_parallel's zigzag
        chunks): attention layers reach the other cp ranks' keys and values by `attention`,
        Mamba-2 layers pass their conv halo and SSM state across ranks (mixers/mamba2_cp.py);
        the loss is this rank's share. Mamba-2 layers under cp need ALL_REDUCE (their batch-
        first in_proj cannot gather a sequence-parallel input)."""
        has_m = any(layer.kind == "M" for layer in self.decoder.values())
        if size > 1 and has_m and self.tp_mode == TensorParallelLinearMode.REDUCE_SCATTER:
            raise ModelConfigError(
                "parallelism.tp_mode REDUCE_SCATTER with context_parallel_size > 1 is not "
                "supported for Mamba-2 layers: use ALL_REDUCE"
            )
        self.cp_size = size
        for layer in self.decoder.values():
            if layer.kind == "*":
                layer.mixer.set_context_parallel(group, size, native_reduce_scatter, attention)
            elif layer.kind == "M":
                layer.mixer.set_context_parallel(group, size, native_reduce_scatter)
            elif layer.kind == "E":  # the balance statistics sum over the cp ranks' tokens
                layer.mixer.set_context_parallel(group, size)
        if hasattr(self, "loss"):
            self.loss.cp_size = size

    def compile_layers(self) -> None:
        """torch.compile each layer: in place, or under recompute the checkpointed call as a
        whole for the layers without a graph break. The chunked scans (M, G and Mamba-1
        layers) and the MoE's statistics run eagerly between compiled graphs, and dynamo runs
        a checkpointed region with a break in it wholly eagerly: those layers are compiled in
        place and checkpointed around the compiled layer (docs/models.md)."""
        param = next(self.parameters())
        for layer in self.decoder.values():
            if layer.kind == "*":
                layer.mixer.backend = resolve_backend(layer.mixer.backend, param.device)
        prepare_compile()
        whole = {k: lay for k, lay in self.decoder.items() if self.recompute and not _breaks(lay)}
        for key, layer in self.decoder.items():
            if key not in whole:
                layer.compile(dynamic=False)
        self._compiled = {
            key: torch.compile(functools.partial(checkpointed, layer), dynamic=False)
            for key, layer in whole.items()
        }

    # ---- training ----
    def prepared(self, batch: Batch) -> Batch:
        """The batch with the document ids (when masking) and the Mamba-2 reset mask: made
        once per micro-batch, not per layer."""
        if not self.config.document_masking or batch.get("position_ids") is None:
            return batch
        out = dict(batch)
        if DOCUMENT_IDS_KEY not in out:
            if self.cp_size > 1:
                raise ValueError(
                    "document masking under context parallel needs the batch's whole-sequence "
                    f"{DOCUMENT_IDS_KEY!r} (position ids are this rank's slice)"
                )
            out[DOCUMENT_IDS_KEY] = document_ids(out["position_ids"])
        if self.cp_size == 1 and any(layer.kind == "M" for layer in self.decoder.values()):
            out[RESET_KEY] = reset_mask_from_document_ids(out[DOCUMENT_IDS_KEY])
        return out

    def forward(self, x: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        recompute = self.recompute and torch.is_grad_enabled()
        batch = self.prepared(batch)
        for name in self.block_names:
            if self.fused_loss and name == "lm_head":
                continue
            block = self.block(name)
            if self.fused_loss and name == "loss":
                x = block(x, batch, head=self.lm_head)
            elif recompute and isinstance(block, HybridLayer):
                compiled = self._compiled.get(name.split(".", 1)[1])
                x = compiled(x, batch) if compiled else checkpointed(block, x, batch)
            else:
                x = block(x, batch)
        assert x is not None
        return x

    # ---- inference ----
    @torch.no_grad()
    def logits(self, input_ids, position_ids=None, decode_state=None, key_mask=None, /):
        """Full logits [b, s, vocab] of new tokens `input_ids` [b, s], continuing the tokens
        `decode_state` (new_hybrid_decode_state) holds; needs every block (pp = 1)."""
        if len(self.decoder) != self.config.num_hidden_layers or "lm_head" not in self.block_names:
            raise ModelConfigError("HybridStage.logits needs every block on this stage (pp = 1)")
        if self.cp_size > 1:
            raise ModelConfigError("HybridStage.logits runs whole sequences: build it without cp")
        batch = self.decoding_batch(input_ids, position_ids, key_mask)
        full = self.gather_logits(self.decode_blocks(None, batch, decode_state))
        if decode_state is not None:
            decode_state.commit(input_ids.shape[1])
        return full.transpose(0, 1)

    def decoding_batch(self, input_ids, position_ids=None, key_mask=None) -> Batch:
        """The batch `decode_blocks` reads. Left padding (key_mask False) is dropped from the
        Mamba-2 states by a reset at each row's first real token."""
        if self.tp_mode == TensorParallelLinearMode.REDUCE_SCATTER and self.pc.tp_size > 1:
            raise ModelConfigError(
                "decoding a Mamba-2 hybrid needs parallelism.tp_mode ALL_REDUCE (sequence "
                "parallel would pad the tokens into the Mamba-2 states)"
            )
        batch: Batch = {"input_ids": input_ids}
        if position_ids is not None:
            batch["position_ids"] = position_ids
        if key_mask is not None:
            batch["key_mask"] = key_mask
            earlier = torch.cat((key_mask.new_zeros(key_mask.shape[0], 1), key_mask[:, :-1]), 1)
            batch[RESET_KEY] = (key_mask & ~earlier)[:, -input_ids.shape[1] :]
        return batch

    @torch.no_grad()
    def decode_blocks(self, x, batch: Batch, decode_state, /) -> torch.Tensor:
        """This stage's blocks but the loss, for decoding; the caller commits `decode_state`."""
        if decode_state is None:
            batch = self.prepared(batch)
        for name in self.block_names:
            if name == "loss":
                continue
            block = self.block(name)
            if isinstance(block, HybridLayer):
                x = block(x, batch, decode_state=decode_state)
            else:
                x = block(x, batch)
        assert x is not None
        return x


# modules with an eager part under compile (the chunked scans; the MoE's statistics)
_EAGER_PARTS = (Mamba2Mixer, GatedDeltaNetMixer, Mamba1Mixer, MoEBlock)


def _breaks(layer: nn.Module) -> bool:
    """Whether a compiled `layer` has a graph break (an eager part) in it."""
    return any(isinstance(m, _EAGER_PARTS) for m in layer.modules())


def prepare_build(
    config: Any, pc, block_names: list[str], all_names: list[str], init_std, device
) -> tuple[float, torch.device]:
    """What every state-space family's builder checks and resolves first: the config at this
    tp, `block_names` known, contiguous and in order among `all_names`; the init std
    (`init_std` or the config's) and the device (`device` or the context's)."""
    config.validate(pc.tp_size)
    idx = [all_names.index(n) if n in all_names else -1 for n in block_names]
    if not idx or -1 in idx or idx != list(range(idx[0], idx[0] + len(idx))):
        raise ModelConfigError(f"block names must be known, contiguous and in order: {block_names}")
    std = config.initializer_range if init_std is None else init_std
    return std, torch.device(device) if device is not None else torch.device(pc.device)


def attention_backend(config: Any, attn_backend: str | None) -> str:
    """The attention layers' kernel: `attn_backend`, or the config's."""
    backend = attn_backend if attn_backend is not None else config.attention_backend
    if backend not in ATTN_BACKENDS:
        raise ModelConfigError(f"attn_backend must be one of {ATTN_BACKENDS}, got {backend!r}")
    return backend


def refuse_mup(parametrization: Any, family: str) -> None:
    if getattr(parametrization, "name", parametrization) != "sp":
        raise ModelConfigError(
            f"model.parametrization / init_method.use_mup: only sp for the {family} family (its "
            "layers have no µP multipliers yet)"
        )


def build_hybrid_stage(
    config: Mamba2HybridConfig,
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
) -> HybridStage:
    """The named contiguous blocks with this rank's tp shards, initialised from `seed` (the
    same full weights whatever the layout); `dispatcher`: how `E` layers reach their experts
    (nanotron_parallel.expert_parallel; None: every expert on this rank)."""
    refuse_mup(parametrization, "Mamba-2")
    std, device = prepare_build(config, pc, block_names, hybrid_block_names(config), init_std,
                                device)  # fmt: skip
    backend = attention_backend(config, attn_backend)
    stage = HybridStage(config, pc, block_names, linear_mode(tp_mode), backend, "meta", dtype,
                        dispatcher)  # fmt: skip
    materialise(stage, config, hybrid_init_spec, pc.tp_rank, pc.tp_size, seed, std, device,
                dtype, scaling_method, parametrization)  # fmt: skip
    fill_head_params(stage, config, seed)
    return stage
