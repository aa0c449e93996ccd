"""Pick the data source of a run: synthetic tokens (`dataset: null`) or the real data path."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from nanotron_train.config import Config, ConfigError
from nanotron_train.synthetic import SyntheticData


def dataset_spec_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """Nanotron accepts a single folder or weight where a list is meant: wrap it."""
    out = dict(raw)
    if isinstance(out.get("dataset_folder"), str):
        out["dataset_folder"] = [out["dataset_folder"]]
    if isinstance(out.get("dataset_weights"), int | float) and not isinstance(
        out.get("dataset_weights"), bool
    ):
        out["dataset_weights"] = [float(out["dataset_weights"])]
    return out


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
    if any(synthetic):
        raise ConfigError(
            "data_stages", "mixing synthetic (dataset: null) and real stages is not supported"
        )
    from nanotron_train.config_loader import from_dict
    from nanotron_train.data import DatasetSpec, StageSpec, TrainData

    stages = [
        StageSpec(
            name=s.name,
            start_training_step=s.start_training_step,
            dataset=from_dict(
                DatasetSpec, dataset_spec_dict(s.data.dataset), f"data_stages.{i}.data.dataset"
            ),
            seed=s.data.seed,
        )
        for i, s in enumerate(cfg.data_stages)
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
