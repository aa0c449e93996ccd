"""Dataset and data-stage specs (Nanotron's keys under ``data_stages``) and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from nanotron_train.data.errors import DataError
from nanotron_train.data.mixer import mixer_error

NANOSET_ONLY = (
    "dataset_folder", "dataset_weights", "dataset_read_path", "tokenizer_name", "vocab_size",
    "token_size_in_bytes", "return_positions", "skip_in_stream",
    "pad_samples_to_global_batch_size", "dataset_max_tokens", "shuffle_files",
    "use_old_brrr_dataloader",
)  # fmt: skip
HF_ONLY = (
    "hf_dataset_or_datasets", "hf_dataset_splits", "hf_dataset_config_name",
    "dataset_processing_num_proc_per_process", "dataset_overwrite_cache", "text_column_name",
)  # fmt: skip


@dataclass
class DatasetSpec:
    """``data_stages[].data.dataset``: Nanotron's NanosetDatasetsArgs or PretrainDatasetsArgs.

    One class for both, as the YAML does not say which it is: ``dataset_folder`` (tokenized
    folders: ours or datatrove's) or ``hf_dataset_or_datasets`` (local raw data, tokenized once
    into the cache). ``validate_stages`` refuses keys of the other kind.
    """

    # Nanoset (tokenized folders)
    dataset_folder: str | list[str] | None = None
    dataset_weights: float | list[float] | None = None
    dataset_read_path: str | list[str] | None = None  # read here instead, where it exists
    tokenizer_name: str | None = None  # must match the folders' tokenizer when given
    vocab_size: int | None = None  # must equal model_config.vocab_size when given
    token_size_in_bytes: int | None = None  # must match the folders' token size when given
    return_positions: bool = False  # true: position_ids restart at each document
    skip_in_stream: bool = False
    pad_samples_to_global_batch_size: bool = False
    dataset_max_tokens: list[int] | None = None  # use only the first N tokens of each folder
    shuffle_files: bool = False
    use_old_brrr_dataloader: bool = False
    # Either kind (ours): true drops from the loss the label after each document's last token
    # (the first token of the next document), as Megatron-LM's --eod-mask-loss.
    eod_mask_loss: bool = False
    # Raw local data
    # local files/folder, tokenized on first use; or Nanotron's mixer {input: fraction}
    hf_dataset_or_datasets: str | dict | list[str] | None = None
    hf_dataset_splits: str | list[str] | None = None  # "train" (Nanotron's default) or a list
    hf_dataset_config_name: str | None = None
    dataset_processing_num_proc_per_process: int = 1  # tokenizer worker processes
    dataset_overwrite_cache: bool = False  # re-tokenize even when the cache has it
    text_column_name: str | None = None  # "text" when null (Nanotron's default)
    # SFTDatasetsArgs (with hf_dataset_or_datasets): true reads chat conversations for
    # supervised fine-tuning (data/sft.py), the loss on the assistant's tokens only
    sft_dataloader: bool | None = None
    debug_max_samples: int | None = None  # SFT: use only the first N conversations
    chat_template: str | None = None  # SFT (ours): Jinja template; null: the tokenizer's

    @property
    def is_sft(self) -> bool:
        return bool(self.sft_dataloader)

    def __post_init__(self) -> None:
        if isinstance(self.dataset_folder, str):
            self.dataset_folder = [self.dataset_folder]
        if isinstance(self.dataset_read_path, str):
            self.dataset_read_path = [self.dataset_read_path]
        if isinstance(self.dataset_weights, (int, float)):
            self.dataset_weights = [float(self.dataset_weights)]
        if isinstance(self.hf_dataset_splits, str):
            self.hf_dataset_splits = [self.hf_dataset_splits]
        if self.text_column_name is None:
            self.text_column_name = "text"


@dataclass
class StageSpec:
    name: str
    start_training_step: int
    dataset: DatasetSpec
    seed: int
    sequence_length: int | None = None  # None: TrainData's sequence_length


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
        error = mixer_error(ds.hf_dataset_or_datasets, ds.hf_dataset_splits)
        if error:
            raise DataError(f"{where}.hf_dataset_or_datasets: {error}")


def stage_index_for_step(stages: list[StageSpec], step: int) -> int:
    """The index of the last stage whose start_training_step <= step."""
    index = 0
    for i, stage in enumerate(stages):
        if stage.start_training_step <= step:
            index = i
    return index
