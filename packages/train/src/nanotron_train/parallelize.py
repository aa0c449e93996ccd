"""`parallelize`: the one place a built model becomes this rank's parallel, trainable model.

`model_factory.build_stage_chunks` builds this rank's blocks (its pipeline stage, or its v
chunks under interleaved 1F1B) with its tp shards. `parallelize` then applies, in this order:

1. Tensor parallel: the tp mode (ALL_REDUCE, or REDUCE_SCATTER = sequence parallel), the
   overlapped linears (`tp_linear_async_communication`, validated by the layers), whether
   reduce-scatters run natively (`pc.tensor_collectives`: NCCL, or forced in tests), and
   `tp_recompute_allgather` (REDUCE_SCATTER: column-parallel linears keep their input shard and
   gather it again in the backward). The loss: with `model.fused_linear_cross_entropy` (the
   default) the last stage computes lm_head and cross-entropy together, token chunk by chunk.
   Context parallel (`parallelism.context_parallel_size`): each attention reaches the cp
   group's keys and values by `parallelism.cp_attention` (all-gather, ring or Ulysses) and the
   loss becomes this rank's share of the sequence's mean (nanotron_parallel.context_parallel);
   set before anything wraps the layers. The trainer
   cuts each micro-batch into this rank's two chunks (`split_batch`).
2. Recompute (`parallelism.recompute_layer`): each decoder layer under activation checkpointing.
3. Compile (`model.compile`): each decoder layer compiled in place, or, with recompute on, the
   checkpointed call of each layer compiled as a whole (as TorchTitan orders them: a layer
   compiled inside the checkpoint can save its tensors in another order when recomputed).
4. Pipeline chunks: v chunks become one `StageChunks` module (tied ends re-tied when one rank
   holds both: pp = 1, or rank 0 under zbv),
   and the tied embedding / lm_head copies of the first and last stage get their group.
5. Data parallel / ZeRO: gradient buffers and the reduction policy of `optimizer.zero_stage`
   (`nanotron_parallel.data_parallel.build_data_parallel`; ZeRO-3 gathers the parameters of each block
   the stage calls, `called_blocks()`, around its forward and backward), over
   the dp x cp group: parameters are replicated over cp as over dp, so their gradients are
   averaged (and ZeRO shards) over both. With cp = 1 that group is the dp group. Expert
   parameters (a MoE model) get buckets of their own over edp x cp, the ranks holding the
   same experts (`SplitGrads`); the experts' dispatcher over the ep group was given to the
   blocks when they were built (model_factory).

Nothing is patched: every step is a method of the model or an object that holds the model's
parameters, and parameter names stay global (`decoder.3.attn.qkv.weight`) whatever is applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanotron_models.chunks import StageChunks
from nanotron_models.stage import ModelStage
from nanotron_parallel.context import ParallelContext
from nanotron_parallel.data_parallel import DataParallelGrads, SplitGrads, build_data_parallel
from nanotron_parallel.pipeline import engine
from nanotron_parallel.sharding import is_expert_param
from nanotron_parallel.tied import TiedParameters, tied_parameters
from nanotron_train.config.context_parallel import cp_attention
from nanotron_train.config.schema import Config


@dataclass
class ParallelModel:
    """What the trainer steps: the model (a ModelStage, or StageChunks), its tied groups and
    its data-parallel gradients."""

    model: nn.Module
    tied: TiedParameters
    grads: DataParallelGrads | SplitGrads

    @property
    def zero_stage(self) -> int:
        return self.grads.zero_stage


def parallelize(
    model: ModelStage | list[ModelStage], cfg: Config, pc: ParallelContext
) -> ParallelModel:
    """Apply the steps of the module docstring, in order, to this rank's chunk(s)."""
    chunks = list(model) if isinstance(model, list) else [model]
    par = cfg.parallelism
    for chunk in chunks:  # 1. tensor parallel, context parallel
        chunk.set_tp_mode(
            par.tp_mode,
            par.tp_linear_async_communication,
            pc.tensor_collectives,
            par.tp_recompute_allgather,
        )
        chunk.set_fused_loss(cfg.model.fused_linear_cross_entropy)
        if pc.cp_size > 1:
            attention = cp_attention(cfg.parallelism, cfg.model.model_config)
            chunk.set_context_parallel(pc.cp_group, pc.cp_size, pc.tensor_collectives, attention)
    for chunk in chunks:  # 2. recompute
        chunk.set_recompute(par.recompute_layer)
    if cfg.model.compile:  # 3. compile
        for chunk in chunks:
            chunk.compile_layers()
    stage: nn.Module = chunks[0] if len(chunks) == 1 else StageChunks(chunks)  # 4. pipeline
    ends_apart = engine(par.pp_engine).last_stage_rank(pc.pp_size, len(chunks)) != 0  # zbv: 0
    tied = tied_parameters(stage, pc, ends_apart)  # collective when pp > 1 and ends apart
    grads = data_parallel(stage, chunks, tied, cfg, pc)  # 5. data parallel / ZeRO
    return ParallelModel(stage, tied, grads)


def data_parallel(
    stage: nn.Module, chunks: list[ModelStage], tied: TiedParameters, cfg: Config, pc
) -> DataParallelGrads | SplitGrads:
    """Step 5: dense parameters over dp x cp; expert parameters (is_expert_param), when the
    model has any, in buckets of their own over edp x cp, summed there and scaled by the same
    1 / (dp * cp) as the dense mean (nanotron_parallel.data_parallel.split)."""
    opt, params = cfg.optimizer, list(stage.parameters())
    common = {
        "grad_dtype": torch.float32 if opt.accumulate_grad_in_fp32 else None,
        "bucket_cap_mb": cfg.model.ddp_bucket_cap_mb,
        "tensor_collectives": pc.tensor_collectives,
        "blocks": [unit for c in chunks for unit in c.called_blocks()],  # ZeRO-3's gather units
    }
    dense = build_data_parallel(
        opt.zero_stage,
        [p for p in params if not is_expert_param(p)],
        pc.dp_cp_group,
        pc.dp_cp_size,
        pc.dp_cp_rank,
        full_reduce={id(p) for g in tied.groups for p in g.params},
        **common,
    )
    experts = [p for p in params if is_expert_param(p)]
    if not experts:
        return dense
    expert_grads = build_data_parallel(
        opt.zero_stage,
        experts,
        pc.edp_cp_group,
        pc.edp_cp_size,
        pc.edp_cp_rank,
        grad_scale=1.0 / pc.dp_cp_size,
        **common,
    )
    return SplitGrads(dense, expert_grads)
