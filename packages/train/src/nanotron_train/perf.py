"""Memory-and-speed options applied to a built model: recompute, async TP, compile, and the
v model chunks of the interleaved 1F1B engine.

- `parallelism.recompute_layer`: every decoder layer runs under non-reentrant
  `torch.utils.checkpoint`: its activations are dropped after the forward and recomputed in the
  backward (the RNG state is restored, so dropout-like ops would replay identically). Only the
  layer's input stays alive. Works inside pipeline stages and with tp / sequence parallel, since
  every tp rank recomputes the same layer in the same order, so the collectives still match.
- `parallelism.tp_linear_async_communication` (REDUCE_SCATTER only): the tp linears switch to
  the overlapped autograd functions of `nanotron_parallel.tensor_parallel.async_linear`.
- `parallelism.tp_recompute_allgather` (REDUCE_SCATTER, Nanotron's default true): the
  column-parallel linears keep their sequence-sharded input and all-gather it again in the
  backward (`tensor_parallel.gather_recompute`) instead of keeping the gathered one.
- `model.compile`: `torch.compile` per decoder layer. On the CPU it rarely pays (tiny kernels,
  long compile times); it is meant for GPUs.

Parameter names stay global (`decoder.3.attn.qkv.weight`) whatever is applied, so
checkpoints are unaffected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanotron_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from nanotron_train.model_factory import build_model, padded_model_config

if TYPE_CHECKING:
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import Config


def enable_recompute(layer: nn.Module) -> None:
    """Recompute `layer`'s activations in the backward instead of keeping them."""
    inner = layer.forward

    def forward(x: torch.Tensor, batch: dict, **kwargs) -> torch.Tensor:
        if not torch.is_grad_enabled():  # inference, generation: nothing to save anyway
            return inner(x, batch, **kwargs)
        return checkpoint(inner, x, batch, use_reentrant=False, preserve_rng_state=True, **kwargs)

    layer.forward = forward  # an instance attribute: nn.Module.__call__ picks it up


def enable_async_tp(stage: nn.Module) -> int:
    """Switch every tp linear of `stage` to overlapped communication; returns how many."""
    n = 0
    for module in stage.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.async_communication = True
            n += 1
    return n


def decoder_layers(stage: nn.Module) -> list[nn.Module]:
    chunks = getattr(stage, "chunks", [stage])
    return [layer for chunk in chunks for layer in getattr(chunk, "decoder", {}).values()]


def apply_perf_options(stage: nn.Module, cfg: Config) -> nn.Module:
    """Apply compile, recompute and async TP as the config asks (compile innermost, so a
    recomputed layer replays the compiled code)."""
    par = cfg.parallelism
    for layer in decoder_layers(stage):
        if cfg.model.compile:
            layer.forward = torch.compile(layer.forward, dynamic=False)
        if par.recompute_layer:
            enable_recompute(layer)
    if par.tp_linear_async_communication:
        enable_async_tp(stage)
    if par.tp_mode == "REDUCE_SCATTER" and par.tp_recompute_allgather:
        for module in stage.modules():  # keep input shards, gather again in the backward
            if isinstance(module, ColumnParallelLinear):
                module.recompute_allgather = True
    return stage


class InterleavedModel(nn.Module):
    """This rank's v chunks for the interleaved 1F1B engine (chunk c = virtual stage
    c * pp + pp_rank), registered under their global block names (`embedding`,
    `decoder.{i}`, ...) so parameter names match every other layout; `chunks` keeps the
    order the schedule runs them in."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.config = chunks[0].config
        self.pc = chunks[0].pc
        self.chunks = list(chunks)  # a plain list: not registered twice
        self.block_names = [n for c in chunks for n in c.block_names]
        self.decoder = nn.ModuleDict()
        for chunk in chunks:
            for name in chunk.block_names:
                if name.startswith("decoder."):
                    self.decoder[name.split(".", 1)[1]] = chunk.block(name)
                else:
                    self.add_module(name, chunk.block(name))

    def forward(self, *args, **kwargs):
        raise RuntimeError("an InterleavedModel is run chunk by chunk by its pipeline schedule")


def build_interleaved_model(cfg: Config, pc: ParallelContext) -> InterleavedModel:
    """Place the blocks over pp * v virtual stages (balanced by cost) and build this rank's."""
    mc = padded_model_config(cfg)
    v, pp = cfg.parallelism.pp_virtual_stages, pc.pp_size
    chunks = [build_model(cfg, pc, c * pp + pc.pp_rank, pp * v) for c in range(v)]
    first, last = chunks[0], chunks[-1]
    if hasattr(first, "embedding") and hasattr(last, "lm_head") and mc.tie_word_embeddings:
        # pp = 1: both ends on this rank, in different chunks; make them one Parameter again.
        last.lm_head.weight = first.embedding.weight
    return InterleavedModel(chunks)


def build_train_model(cfg: Config, pc: ParallelContext) -> nn.Module:
    """The trainer's model for this rank: one stage, or v chunks for interleaved-1f1b; with
    the perf options applied."""
    if cfg.parallelism.pp_engine == "interleaved-1f1b":
        model: nn.Module = build_interleaved_model(cfg, pc)
    else:
        model = build_model(cfg, pc)
    return apply_perf_options(model, cfg)
