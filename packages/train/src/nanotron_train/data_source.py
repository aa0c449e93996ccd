"""Pick the data source of a run: synthetic tokens (`dataset: null`) or the real data path."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from nanotron_train.config import Config
from nanotron_train.data import StageSpec, TrainData
from nanotron_train.synthetic import SyntheticData


def build_data(cfg: Config, pc) -> Any:
    """This dp rank's data: `micro_batches(step)`, `state_dict()`, `load_state_dict()`."""
    tok = cfg.tokens
    synthetic = [s.data.dataset is None for s in cfg.data_stages]
    if all(synthetic):
        first = cfg.data_stages[0].data
        return SyntheticData(
            seed=first.seed,
            sequence_length=tok.sequence_length,
            vocab_size=cfg.model.model_config.vocab_size,
            micro_batch_size=tok.micro_batch_size,
            accumulation=tok.batch_accumulation_per_replica,
            dp_size=pc.dp_size,
            dp_rank=pc.dp_rank,
        )
    stages = [
        StageSpec(
            name=s.name,
            start_training_step=s.start_training_step,
            dataset=s.data.dataset,
            seed=s.data.seed,
        )
        for s in cfg.data_stages
    ]
    return TrainData(
        stages,
        sequence_length=tok.sequence_length,
        micro_batch_size=tok.micro_batch_size,
        batch_accumulation_per_replica=tok.batch_accumulation_per_replica,
        dp_rank=pc.dp_rank,
        dp_size=pc.dp_size,
        tokenizer_path=cfg.tokenizer.tokenizer_name_or_path,
        cache_dir=os.environ.get("NANOTRON_DATA_CACHE", ".cache/data"),
        model_vocab_size=cfg.model.model_config.vocab_size,
        barrier=lambda: dist.barrier(),
        is_builder=pc.rank == 0,
    )
