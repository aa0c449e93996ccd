"""LlamaStage: the contiguous blocks of one pipeline stage, with this rank's tp shards only."""

from __future__ import annotations

import functools

import torch
from torch import nn

from nanotron_parallel.compile_boundary import prepare_compile
from nanotron_parallel.sharding import (
    gather_full,
    get_param_meta,
)
from nanotron_parallel.tensor_parallel import (
    TensorParallelLinearMode,
)

from .attention import resolve_backend
from .blocks import Batch, DecoderLayer, Embedding, LMHead, Loss, RMSNorm, linear_mode
from .config import ATTN_BACKENDS, LlamaConfig, ModelConfigError
from .flops import llama_block_names
from .init import llama_init_spec
from .kv_cache import KVCache
from .masks import DOCUMENT_IDS_KEY, document_ids
from .materialise import TIED_KEY as TIED_KEY  # the name tied parameters share
from .materialise import load_full_tensors, materialise, missing_parameters
from .moe import MoEBlock, moe_layers_of
from .parametrization import Multipliers, Parametrization, multipliers
from .rotary import RotaryTable
from .stage_plumbing import StagePlumbing, checkpointed


class LlamaStage(StagePlumbing, nn.Module):
    """Some contiguous blocks of the Llama. Submodules `embedding`, `decoder` (ModuleDict keyed
    by the global layer index), `final_norm`, `lm_head`, `loss`: each only if in block_names.

    Options that change how, not what, the stage computes are set by methods after it is
    built (the trainer's `parallelize` calls them): `set_tp_mode`, `set_context_parallel`,
    `set_recompute`, `compile_layers`, `set_fused_loss`. Parameter names stay the same whatever
    is applied.
    """

    def __init__(
        self,
        config: LlamaConfig,
        pc,
        block_names: list[str],
        tp_mode: TensorParallelLinearMode,
        attn_backend: str,
        device,
        dtype,
        dispatcher=None,
        multipliers: Multipliers | None = None,
    ):
        super().__init__()
        self.config, self.pc, self.block_names = config, pc, list(block_names)
        self.tp_mode = tp_mode
        group, c = pc.tp_group, config
        vpad = c.padded_vocab_size(pc.tp_size)
        self.rotary = RotaryTable(c.head_dim, c.rope_theta, c.rope_scaling, c.rope_interpolation)
        kw = {"device": device, "dtype": dtype}
        if "embedding" in block_names:
            self.embedding = Embedding(vpad, c.hidden_size, group, tp_mode, **kw)
            # a weight tied to the lm_head gets two gradients: autograd sums them
            self.embedding.fuse_grad_accumulation = not c.tie_word_embeddings
        layers = [int(n.split(".")[1]) for n in block_names if n.startswith("decoder.")]
        moe = moe_layers_of(c)  # these layers' MLP is a mixture of experts (moe/)
        self.decoder = nn.ModuleDict(
            {
                str(i): DecoderLayer(
                    c,
                    i,
                    group,
                    tp_mode,
                    self.rotary,
                    attn_backend,
                    **kw,
                    mlp=MoEBlock(c, i, group, tp_mode, dispatcher, **kw) if i in moe else None,
                )
                for i in layers
            }
        )
        if "final_norm" in block_names:
            sp = tp_mode == TensorParallelLinearMode.REDUCE_SCATTER
            fused = getattr(c, "_fused_rms_norm", True)
            self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, group, sp, fused=fused, **kw)
        m = multipliers or Multipliers()  # parametrization.py: µP / CompleteP's constants
        for layer in self.decoder.values():
            layer.residual_multiplier, layer.attn.q_multiplier = m.residual, m.attention_q
        if "final_norm" in block_names:  # the lm_head's input: µP's readout multiplier
            self.final_norm.output_multiplier = m.output
        if "lm_head" in block_names:
            self.lm_head = LMHead(c.hidden_size, vpad, group, tp_mode, **kw)
            self.lm_head.fuse_grad_accumulation = not c.tie_word_embeddings
        if "loss" in block_names:
            self.loss = Loss(c.vocab_size, group, c.z_loss_weight)
        self.recompute = False
        self._compiled_checkpoints: dict = {}  # compile_layers with recompute on
        self.fused_loss = False
        self.set_fused_loss(True)

    def set_context_parallel(
        self,
        group,
        size: int,
        native_reduce_scatter: bool | None = None,
        attention: str | None = None,
    ) -> None:
        """Train on 1/cp of every sequence (nanotron_parallel.context_parallel): the attention
        of each layer reaches the other cp ranks' keys and values by `attention` (allgather,
        ring, ulysses; None keeps the current one: allgather when never set), and the loss is
        this rank's share of the micro-batch's token-weighted mean, times cp. The batches
        must be cut with `context_parallel.split_batch`. Inference (`logits`) keeps whole
        sequences."""
        for layer in self.decoder.values():
            layer.attn.set_context_parallel(group, size, native_reduce_scatter, attention)
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.set_context_parallel(group, size)
        if hasattr(self, "loss"):
            self.loss.cp_size = size

    def compile_layers(self) -> None:
        """`torch.compile` each decoder layer in place (nn.Module.compile: names unchanged).
        With recompute on (call `set_recompute` first), the checkpointed call is compiled as a
        whole, as TorchTitan does: compiling the layer inside the checkpoint can save tensors
        in another order when the backward recomputes it."""
        # The rotary table grows on demand (a dict write, which a compiled checkpoint cannot
        # replay): build it for every position first, so compiled code only reads it.
        param = next(self.parameters())
        self.rotary.cos_sin(
            torch.zeros(1, dtype=torch.long), param.device, param.dtype,
            self.config.max_position_embeddings,
        )  # fmt: skip
        for layer in self.decoder.values():  # pick the attention kernel now (it may log)
            layer.attn.backend = resolve_backend(layer.attn.backend, param.device)
        prepare_compile()  # collectives and statistics stay out of the graphs
        if not self.recompute:
            for layer in self.decoder.values():
                layer.compile(dynamic=False)
            return
        self._compiled_checkpoints = {
            key: torch.compile(functools.partial(checkpointed, layer), dynamic=False)
            for key, layer in self.decoder.items()
        }

    def with_document_ids(self, batch: Batch) -> Batch:
        """The batch with its document ids when a layer masks documents and the data gave
        only position ids: derived once per micro-batch, not per layer. Under context
        parallel the positions are this rank's slice: the data must give the whole-sequence
        ids (it always does when masking is on)."""
        if DOCUMENT_IDS_KEY in batch or batch.get("position_ids") is None:
            return batch
        if not any(layer.attn.document_masking for layer in self.decoder.values()):
            return batch
        if any(layer.attn.cp_size > 1 for layer in self.decoder.values()):
            raise ValueError(
                "document masking under context parallel needs the batch's whole-sequence "
                f"{DOCUMENT_IDS_KEY!r} (position ids are this rank's slice)"
            )
        return {**batch, DOCUMENT_IDS_KEY: document_ids(batch["position_ids"])}

    def forward(self, x: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        recompute = self.recompute and torch.is_grad_enabled()
        batch = self.with_document_ids(batch)
        for name in self.block_names:
            if self.fused_loss and name == "lm_head":
                continue  # the loss block runs the lm_head (set_fused_loss)
            block = self.block(name)
            if self.fused_loss and name == "loss":
                x = block(x, batch, head=self.lm_head)  # Loss.from_hidden
            elif recompute and isinstance(block, DecoderLayer):
                compiled = self._compiled_checkpoints.get(name.split(".", 1)[1])
                x = compiled(x, batch) if compiled else checkpointed(block, x, batch)
            else:
                x = block(x, batch)
        assert x is not None
        return x

    @torch.no_grad()
    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full logits [b, s, vocab] (gathered over tp, vocab padding dropped) for new tokens
        `input_ids` [b, s]; with `kv_cache`, the tokens continue the cached ones. `key_mask`
        [b, cached + s] (True = real token) hides the left padding of batched prompts.

        Needs a stage holding embedding .. lm_head (pp = 1). In REDUCE_SCATTER mode the new
        tokens are right-padded to a multiple of tp (causality keeps the real tokens exact and
        the cache drops the padding).
        """
        missing = {"embedding", "final_norm", "lm_head"} - set(self.block_names)
        if missing or len(self.decoder) != self.config.num_hidden_layers:
            raise ModelConfigError("LlamaStage.logits needs every block on this stage (pp = 1)")
        if any(layer.attn.cp_size > 1 for layer in self.decoder.values()):
            raise ModelConfigError(
                "LlamaStage.logits runs whole sequences: build the model without context parallel"
            )
        s = input_ids.shape[1]
        batch = self.decoding_batch(input_ids, position_ids, key_mask)
        full = self.gather_logits(self.decode_blocks(None, batch, kv_cache))
        if kv_cache is not None:
            kv_cache.commit(s)
        return full.transpose(0, 1)[:, :s]

    def decoding_batch(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> Batch:
        """The batch `decode_blocks` reads. In REDUCE_SCATTER mode the new tokens are
        right-padded to a multiple of tp (causality keeps the real tokens exact; the caller
        commits only the real ones to the cache)."""
        b, s = input_ids.shape
        tp = self.pc.tp_size
        pad = (-s) % tp if self.tp_mode == TensorParallelLinearMode.REDUCE_SCATTER else 0
        if pad:
            input_ids = torch.cat((input_ids, input_ids[:, -1:].expand(b, pad)), dim=1)
            if position_ids is not None:
                position_ids = torch.cat((position_ids, position_ids[:, -1:].expand(b, pad)), dim=1)
            if key_mask is not None:
                key_mask = torch.cat((key_mask, key_mask.new_ones(b, pad)), dim=1)
        batch: Batch = {"input_ids": input_ids}
        if position_ids is not None:
            batch["position_ids"] = position_ids
        if key_mask is not None:
            batch["key_mask"] = key_mask
        return batch

    @torch.no_grad()
    def decode_blocks(
        self, x: torch.Tensor | None, batch: Batch, kv_cache: KVCache | None
    ) -> torch.Tensor:
        """This stage's blocks but the loss, for decoding: token ids (x None, from `batch`) or
        the previous stage's hidden state in; a hidden state, or the lm_head's logit shard
        when the stage holds it, out. The caller commits the new tokens to `kv_cache` once
        every stage of the step ran."""
        if kv_cache is None:
            batch = self.with_document_ids(batch)
        for name in self.block_names:
            if name == "loss":
                continue
            block = self.block(name)
            if isinstance(block, DecoderLayer):
                x = block(x, batch, kv_cache=kv_cache)
            else:
                x = block(x, batch)
        assert x is not None
        return x


def build_llama_stage(
    config: LlamaConfig,
    pc,
    block_names: list[str],
    *,
    tp_mode: str | TensorParallelLinearMode = TensorParallelLinearMode.ALL_REDUCE,
    seed: int = 42,
    init_std: float | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    attn_backend: str | None = None,
    scaling_method: str = "NUM_LAYERS",
    dispatcher=None,
    parametrization: str | Parametrization = "sp",
) -> LlamaStage:
    """Build the named contiguous blocks with this rank's tp shards, initialised from `seed`.

    init_std defaults to config.initializer_range; attn_backend to config.attention_backend
    (attn_backend, else Nanotron's _attn_implementation); scaling_method: see init.py;
    dispatcher: how MoE layers reach their experts (nanotron_parallel.expert_parallel; None:
    every expert on this rank), which also says which experts this rank holds;
    parametrization: `sp`, `spectral_mup` or a Parametrization (mup, completep:
    parametrization.py).
    """
    config.validate(pc.tp_size)
    names = llama_block_names(config)
    unknown = [n for n in block_names if n not in names]
    if unknown or not block_names:
        raise ModelConfigError(f"unknown or empty block names {unknown or block_names}")
    idx = [names.index(n) for n in block_names]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ModelConfigError(f"block names must be contiguous and in order, got {block_names}")
    backend = attn_backend if attn_backend is not None else config.attention_backend
    if backend not in ATTN_BACKENDS:
        raise ModelConfigError(f"attn_backend must be one of {ATTN_BACKENDS}, got {backend!r}")
    std = config.initializer_range if init_std is None else init_std
    device = torch.device(device) if device is not None else torch.device(pc.device)
    # Build on the meta device (no memory, no throw-away init), then fill every parameter.
    stage = LlamaStage(
        config, pc, block_names, linear_mode(tp_mode), backend, "meta", dtype, dispatcher,
        multipliers(parametrization, config.head_dim),
    )  # fmt: skip
    materialise(
        stage, config, llama_init_spec, pc.tp_rank, pc.tp_size, seed, std, device, dtype,
        scaling_method, parametrization,
    )  # fmt: skip
    return stage


def build_llama(config: LlamaConfig, pc, **kwargs) -> LlamaStage:
    """One stage holding every block (pp = 1)."""
    return build_llama_stage(config, pc, llama_block_names(config), **kwargs)


def full_state_dict(stage: LlamaStage, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of the stage as a full tensor: gathered over tp,
    vocab padding dropped, tied lm_head included. Collective over the tp group.
    """
    out = {}
    vocab = stage.config.vocab_size
    for name, param in stage.named_parameters(remove_duplicate=False):
        t = param.grad if grads else param
        if t is None:
            raise ValueError(f"parameter {name} has no gradient")
        meta = get_param_meta(param)
        if meta is None or meta.shard_dim is None:
            full = t.detach().clone()
        else:
            full = gather_full(t, stage.pc.tp_group, meta.shard_dim, meta.sections)
        if name in ("embedding.weight", "lm_head.weight"):
            full = full[:vocab]
        out[name] = full.cpu()
    return out


def load_full_state_dict(stage: LlamaStage, full_sd: dict[str, torch.Tensor]) -> None:
    """Copy full (unpadded) tensors into this rank's shards of the stage's parameters."""
    from .hf import HFConversionError

    missing = missing_parameters(stage, full_sd)
    if missing:
        raise HFConversionError(f"state dict lacks {missing}")
    load_full_tensors(stage, full_sd, llama_init_spec)
