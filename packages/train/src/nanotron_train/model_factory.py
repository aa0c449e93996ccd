"""Build this rank's part of the Llama from a training config.

One place for what the trainer, the interleaved pipeline (perf.py) and the HF import
(convert.py) all need: the dtype names, the vocabulary padding, and one (virtual) stage.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from nanotron_models import LlamaConfig
from nanotron_models.flops import llama_block_costs, llama_block_names
from nanotron_models.model import LlamaStage, build_llama_stage
from nanotron_parallel.context import ParallelContext
from nanotron_parallel.pipeline import stage_block_names
from nanotron_train.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def padded_model_config(cfg: Config) -> LlamaConfig:
    """Nanotron rounds the vocabulary up to make_vocab_size_divisible_by (layout-independent)."""
    mc = cfg.model.model_config
    div = cfg.model.make_vocab_size_divisible_by
    padded = -(-mc.vocab_size // div) * div
    return mc if padded == mc.vocab_size else replace(mc, vocab_size=padded)


def build_model(
    cfg: Config,
    pc: ParallelContext,
    stage: int | None = None,
    num_stages: int | None = None,
) -> LlamaStage:
    """The blocks of pipeline stage `stage` of `num_stages` (default: this rank's of pp),
    balanced by estimated compute, with this rank's tp shards."""
    mc = padded_model_config(cfg)
    stage = pc.pp_rank if stage is None else stage
    num_stages = pc.pp_size if num_stages is None else num_stages
    names = llama_block_names(mc)
    costs = llama_block_costs(mc, cfg.tokens.sequence_length)
    return build_llama_stage(
        mc,
        pc,
        stage_block_names(names, costs, num_stages, stage),
        tp_mode=cfg.parallelism.tp_mode,
        seed=cfg.general.seed,
        init_std=cfg.model.init_method.std,
        scaling_method=cfg.model.init_method.scaling_method,
        dtype=DTYPES[cfg.model.dtype],
        device=pc.device,
    )
