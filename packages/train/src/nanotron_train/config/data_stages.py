"""The checks of one data stage (`data_stages[i]`), run by checks.py once per stage with `{i}` in
their key the stage's index: its sequence length against the model and tp, its dataset keys
(which of Nanotron's two dataset classes, lists that must match in length, Nanotron options this
project refuses), then the SFT and dataset-mixer rows of their own modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanotron_train.config.mixer import MIXER_CHECKS
from nanotron_train.config.rules import Check
from nanotron_train.config.sft import SFT_STAGE_CHECKS
from nanotron_train.data.stages import HF_ONLY, NANOSET_ONLY, DatasetSpec

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config, DatasetStageArgs


def _spec_kind_error(ds: DatasetSpec | None) -> str | None:
    """Keys of Nanotron's other dataset class (Nanoset vs Hugging Face) given with this one."""
    if ds is None:
        return None
    if (ds.dataset_folder is None) == (ds.hf_dataset_or_datasets is None):
        return "give exactly one of dataset_folder or hf_dataset_or_datasets"
    default = DatasetSpec()
    others = HF_ONLY if ds.dataset_folder is not None else NANOSET_ONLY
    kind = "dataset_folder" if ds.dataset_folder is not None else "hf_dataset_or_datasets"
    for key in others:
        if getattr(ds, key) != getattr(default, key) and key != "text_column_name":
            return f"{key} does not apply with {kind}"
    if ds.dataset_folder is not None and ds.text_column_name != "text":
        return f"text_column_name does not apply with {kind}"
    return None


def _count_error(ds: DatasetSpec | None) -> str | None:
    if ds is None or ds.dataset_folder is None:
        return None
    n = len(ds.dataset_folder)
    if n == 0:
        return "dataset_folder: the list is empty"
    for key in ("dataset_weights", "dataset_read_path", "dataset_max_tokens"):
        given = getattr(ds, key)
        if given is not None and len(given) != n:
            return f"{key}: {len(given)} values for {n} folders"
    weights = ds.dataset_weights or [1.0]
    if any(w < 0 for w in weights) or not sum(weights) > 0:
        return f"dataset_weights: {weights} must be non-negative and sum to more than 0"
    if any(t < 1 for t in ds.dataset_max_tokens or []):
        return f"dataset_max_tokens: {ds.dataset_max_tokens} must be >= 1"
    return None


def _seq(cfg: Config, stage: DatasetStageArgs) -> int:
    return stage.sequence_length or cfg.tokens.sequence_length


def _dataset(stage: DatasetStageArgs) -> DatasetSpec:
    return stage.data.dataset or DatasetSpec()


STAGE_CHECKS: tuple[Check, ...] = (
    Check(
        "data_stages.{i}.sequence_length",
        lambda c, s: _seq(c, s) <= c.model.model_config.max_position_embeddings,
        lambda c, s: (
            f"{_seq(c, s)} exceeds model.model_config.max_position_embeddings="
            f"{c.model.model_config.max_position_embeddings}"
        ),
    ),
    Check(
        "data_stages.{i}.sequence_length",
        lambda c, s: s.sequence_length is None or s.sequence_length >= 1,
        "must be >= 1 or null",
    ),
    Check(
        "data_stages.{i}.sequence_length",
        lambda c, s: (
            c.parallelism.tp_mode != "REDUCE_SCATTER" or _seq(c, s) % c.parallelism.tp == 0
        ),
        lambda c, s: (
            f"{_seq(c, s)} must be divisible by tp={c.parallelism.tp} in REDUCE_SCATTER mode"
        ),
    ),
    Check(
        "data_stages.{i}.data.num_loading_workers",
        lambda c, s: s.data.num_loading_workers >= 0,
        "must be >= 0",
    ),
    Check(
        "data_stages.{i}.data.dataset.token_size_in_bytes",
        lambda c, s: _dataset(s).token_size_in_bytes in (None, 2, 4),
        "must be 2 or 4",
    ),
    Check(
        "data_stages.{i}.data.dataset.skip_in_stream",
        lambda c, s: not _dataset(s).skip_in_stream,
        "true asks to skip consumed samples by reading through them; resume here seeks to the "
        "position directly (the same samples): set it to false",
    ),
    Check(
        "data_stages.{i}.data.dataset.pad_samples_to_global_batch_size",
        lambda c, s: not _dataset(s).pad_samples_to_global_batch_size,
        "true pads a last partial batch; here the sample stream wraps into a new epoch and "
        "every batch is full: set it to false",
    ),
    Check(
        "data_stages.{i}.data.dataset.use_old_brrr_dataloader",
        lambda c, s: not _dataset(s).use_old_brrr_dataloader,
        "true asks for Nanotron's legacy brrr dataloader, which this project does not have",
    ),
    Check(
        "data_stages.{i}.data.dataset.hf_dataset_config_name",
        lambda c, s: _dataset(s).hf_dataset_config_name is None,
        "selects a configuration of a Hugging Face hub dataset; downloading from the hub is "
        "not part of this project (give a local dataset folder or files, and null here)",
    ),
    *SFT_STAGE_CHECKS,
    *MIXER_CHECKS,
    Check(
        "data_stages.{i}.data.dataset",
        lambda c, s: _spec_kind_error(s.data.dataset) is None,
        lambda c, s: _spec_kind_error(s.data.dataset),
    ),
    Check(
        "data_stages.{i}.data.dataset",
        lambda c, s: _count_error(s.data.dataset) is None,
        lambda c, s: _count_error(s.data.dataset),
    ),
    Check(
        "data_stages.{i}.data.dataset.vocab_size",
        lambda c, s: _dataset(s).vocab_size in (None, c.model.model_config.vocab_size),
        lambda c, s: (
            f"{_dataset(s).vocab_size} differs from model.model_config.vocab_size="
            f"{c.model.model_config.vocab_size} (Nanotron refuses this too)"
        ),
    ),
    Check(
        "data_stages.{i}.data.dataset.dataset_processing_num_proc_per_process",
        lambda c, s: _dataset(s).dataset_processing_num_proc_per_process >= 1,
        "must be >= 1",
    ),
)
