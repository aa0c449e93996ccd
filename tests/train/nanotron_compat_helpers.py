"""What the Nanotron-compatibility tests share: Nanotron's example YAML, a tiny Llama config in
Nanotron's keys, and trainers built from it on one process (test_nanotron_compat*.py)."""

from __future__ import annotations

import io
from pathlib import Path

import yaml

from nanotron_train.config import config_from_dict

HERE = Path(__file__).parent / "nanotron"
EXAMPLE = HERE / "config_tiny_llama.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


TINY = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32,
}  # fmt: skip


def tiny_config(**model_config) -> dict:
    return {
        "general": {"project": "t", "run": "r", "seed": 3},
        "model": {"model_config": {**TINY, **model_config}, "dtype": "float32"},
        "tokens": {"sequence_length": 16, "micro_batch_size": 2,
                   "batch_accumulation_per_replica": 1, "train_steps": 3},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-2}, "weight_decay": 0.5},
        "data_stages": [{"name": "s", "start_training_step": 1, "data": {"seed": 1}}],
    }  # fmt: skip


def one_step(trainer) -> dict:
    """One training step and its metrics record (as a logged step makes it)."""
    return trainer.step_record(trainer.train_step(), 0.0)


def train_records(trainer) -> list[dict]:
    """Train to the end; every logged step's record."""
    records: list[dict] = []
    trainer.train(on_record=records.append)
    return records


def make_trainer(data: dict):
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    return Trainer(config_from_dict(data), ParallelContext(1, 1, 1), stream=io.StringIO())


def stages_config(tmp_path: Path, nanoset: Path, steps: int, resume: bool = False) -> dict:
    data = tiny_config()
    data["tokens"]["train_steps"] = steps
    data["data_stages"] = [
        {"name": "warm", "start_training_step": 1, "data": {"seed": 1}, "sequence_length": 16},
        {"name": "real", "start_training_step": 3, "sequence_length": 8,
         "data": {"seed": 2, "dataset": {"dataset_folder": str(nanoset)}}},
        {"name": "synth2", "start_training_step": 5, "data": {"seed": 9}},
    ]  # fmt: skip
    data["checkpoints"] = {
        "checkpoints_path": str(tmp_path / "ck"), "checkpoint_interval": 4,
        "resume_checkpoint_path": str(tmp_path / "ck") if resume else None,
    }  # fmt: skip
    return data
