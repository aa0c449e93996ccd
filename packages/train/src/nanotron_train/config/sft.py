"""Checks of a data stage's SFT keys (Nanotron's SFTDatasetsArgs: `sft_dataloader`,
`debug_max_samples`; ours: `chat_template`), run per stage with the other stage checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanotron_train.config.rules import Check
from nanotron_train.data.stages import DatasetSpec

if TYPE_CHECKING:
    from nanotron_train.config.schema import DatasetStageArgs


def _ds(stage: DatasetStageArgs) -> DatasetSpec:
    return stage.data.dataset or DatasetSpec()


def _sft(stage: DatasetStageArgs) -> bool:
    return _ds(stage).is_sft


def _splits_ok(ds: DatasetSpec) -> bool:
    return ds.hf_dataset_splits in (None, ["train"])


SFT_STAGE_CHECKS: tuple[Check, ...] = (
    Check(
        "data_stages.{i}.data.dataset.sft_dataloader",
        lambda c, s: not _sft(s) or _ds(s).dataset_folder is None,
        "reads conversations (JSONL) from hf_dataset_or_datasets, not a tokenized dataset_folder",
    ),
    *(
        Check(
            f"data_stages.{{i}}.data.dataset.{key}",
            lambda c, s, key=key: _sft(s) or getattr(_ds(s), key) is None,
            "applies only to SFT data: set sft_dataloader: true, or remove it",
        )
        for key in ("debug_max_samples", "chat_template")
    ),
    Check(
        "data_stages.{i}.data.dataset.debug_max_samples",
        lambda c, s: _ds(s).debug_max_samples is None or _ds(s).debug_max_samples >= 1,
        "must be >= 1 (the number of examples to use) or null (all)",
    ),
    Check(
        "data_stages.{i}.data.dataset.eod_mask_loss",
        lambda c, s: not (_sft(s) and _ds(s).eod_mask_loss),
        "does not apply to SFT data: only the assistant's tokens have labels there",
    ),
    Check(
        "data_stages.{i}.data.dataset.hf_dataset_splits",
        lambda c, s: not _sft(s) or _splits_ok(_ds(s)),
        "SFT data is read whole from its JSONL file or folder (the train split): remove it",
    ),
    Check(
        "validation.split",
        lambda c, s: not _sft(s) or c.validation is None or c.validation.split is None,
        "SFT stages hold no documents out: give validation.dataset instead",
    ),
)
