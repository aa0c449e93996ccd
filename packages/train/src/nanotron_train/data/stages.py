"""Dataset and data-stage specs (Nanotron's keys under ``data_stages``) and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from nanotron_train.data.errors import DataError


@dataclass
class DatasetSpec:
    """``data_stages[].data.dataset``: Nanoset folder(s) with weights, or a raw local dataset."""

    dataset_folder: list[str] | None = None  # a single str is accepted and wrapped
    dataset_weights: list[float] | None = None
    hf_dataset_or_datasets: str | None = None  # local files/folder, tokenized on first use
    text_column_name: str = "text"

    def __post_init__(self) -> None:
        if isinstance(self.dataset_folder, str):
            self.dataset_folder = [self.dataset_folder]
        if isinstance(self.dataset_weights, (int, float)):
            self.dataset_weights = [float(self.dataset_weights)]


@dataclass
class StageSpec:
    name: str
    start_training_step: int
    dataset: DatasetSpec
    seed: int


def check_weights(weights: list[float] | None, count: int, where: str) -> list[float]:
    """Weights for ``count`` datasets, normalised to sum to 1 (equal when not given)."""
    if weights is None:
        return [1.0 / count] * count
    if len(weights) != count:
        raise DataError(f"{where}.dataset_weights: {len(weights)} weights for {count} folders")
    if any(not isinstance(w, (int, float)) or w < 0 for w in weights):
        raise DataError(f"{where}.dataset_weights: {weights} must be non-negative numbers")
    total = float(sum(weights))
    if not total > 0:
        raise DataError(f"{where}.dataset_weights: {weights} must sum to a positive number")
    return [float(w) / total for w in weights]


def validate_stages(stages: list[StageSpec]) -> None:
    """First stage at step 1, strictly increasing starts, unique names, one source each."""
    if not stages:
        raise DataError("data_stages: at least one stage is needed")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise DataError(f"data_stages: stage names must be unique, got {names}")
    if stages[0].start_training_step != 1:
        raise DataError(
            f"data_stages[0] ({stages[0].name!r}).start_training_step is "
            f"{stages[0].start_training_step}: the first stage must start at step 1"
        )
    for i, (prev, cur) in enumerate(zip(stages, stages[1:]), start=1):
        if cur.start_training_step <= prev.start_training_step:
            raise DataError(
                f"data_stages[{i}] ({cur.name!r}).start_training_step {cur.start_training_step} "
                f"must be greater than the previous stage's {prev.start_training_step}"
            )
    for i, stage in enumerate(stages):
        where = f"data_stages[{i}].data.dataset"
        ds = stage.dataset
        if (ds.dataset_folder is None) == (ds.hf_dataset_or_datasets is None):
            raise DataError(
                f"{where}: give exactly one of dataset_folder or hf_dataset_or_datasets"
            )
        if ds.dataset_folder is not None:
            if not ds.dataset_folder:
                raise DataError(f"{where}.dataset_folder: the list is empty")
            check_weights(ds.dataset_weights, len(ds.dataset_folder), where)
        elif ds.dataset_weights is not None:
            raise DataError(f"{where}.dataset_weights: only valid with dataset_folder")


def stage_index_for_step(stages: list[StageSpec], step: int) -> int:
    """The index of the last stage whose start_training_step <= step."""
    index = 0
    for i, stage in enumerate(stages):
        if stage.start_training_step <= step:
            index = i
    return index
