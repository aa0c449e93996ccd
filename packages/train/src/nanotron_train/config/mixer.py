"""Checks of Nanotron's dataset mixer, ``hf_dataset_or_datasets: {input: fraction}``
(data/mixer.py holds the rules and what it reads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanotron_train.config.rules import Check
from nanotron_train.data.mixer import mixer_error
from nanotron_train.data.stages import DatasetSpec

if TYPE_CHECKING:
    from nanotron_train.config.schema import DatasetStageArgs

_KEY = "data_stages.{i}.data.dataset.hf_dataset_or_datasets"


def _ds(stage: DatasetStageArgs) -> DatasetSpec:
    return stage.data.dataset or DatasetSpec()


MIXER_CHECKS: tuple[Check, ...] = (
    Check(
        _KEY,
        lambda c, s: mixer_error(_ds(s).hf_dataset_or_datasets, _ds(s).hf_dataset_splits) is None,
        lambda c, s: str(mixer_error(_ds(s).hf_dataset_or_datasets, _ds(s).hf_dataset_splits)),
    ),
    Check(
        _KEY,
        lambda c, s: not _ds(s).is_sft or not isinstance(_ds(s).hf_dataset_or_datasets, dict),
        "SFT data is one JSONL file or folder of conversations: a dataset mapping is not read",
    ),
)
