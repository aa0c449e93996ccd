"""Checks of held-out evaluation: the `validation` section (schema.py) and Nanotron's `tokens`
keys for it.

- `validation.dataset`: a separate Nanoset folder or blend, with the keys of
  `data_stages[].data.dataset` (`dataset_folder`, `dataset_weights`, `eod_mask_loss`), or
  held-out conversations (`hf_dataset_or_datasets` with `sft_dataloader: true`, data/sft.py);
- `validation.split`: the fraction of documents of every training folder held out instead;
- `tokens.val_check_interval` (Nanotron): steps between evaluations; -1 = only at the end;
- `tokens.limit_val_batches` (Nanotron): validation batches (global batches) per evaluation;
  0 = the whole validation set.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from nanotron_train.config.rules import Check
from nanotron_train.data.stages import DatasetSpec

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config
_USED = ("dataset_folder", "dataset_weights", "eod_mask_loss")
# held-out conversations (data/sft.py): the SFT keys of data_stages[].data.dataset
_USED_SFT = (
    "hf_dataset_or_datasets",
    "sft_dataloader",
    "debug_max_samples",
    "chat_template",
    "dataset_overwrite_cache",
)


def _split(cfg: Config) -> bool:
    return cfg.validation is not None and cfg.validation.split is not None


def _names(keys: tuple[str, ...]) -> str:
    return ", ".join(keys[:-1]) + " and " + keys[-1]


def _sft(cfg: Config) -> bool:
    """`validation.dataset` holds conversations (SFT), not tokenized folders."""
    return _folder(cfg) and cfg.validation.dataset.is_sft


def _folder(cfg: Config) -> bool:
    """A `validation.dataset` section is the one given."""
    return cfg.validation is not None and cfg.validation.split is None


def _unused_key(cfg: Config) -> str | None:
    """The first key of `validation.dataset` given that validation does not read."""
    spec, defaults = cfg.validation.dataset, DatasetSpec()
    used = _USED_SFT if spec.is_sft else _USED
    return next(
        (
            f.name
            for f in dataclasses.fields(DatasetSpec)
            if f.name not in used and getattr(spec, f.name) != getattr(defaults, f.name)
        ),
        None,
    )


def _needs_section(key: str, default: int) -> Check:
    return Check(
        f"tokens.{key}",
        lambda c: c.validation is not None or getattr(c.tokens, key) == default,
        "needs a validation section (validation.dataset or validation.split) to evaluate on",
    )


VALIDATION_CHECKS: tuple[Check, ...] = (
    Check(
        "tokens.val_check_interval",
        lambda c: c.tokens.val_check_interval == -1 or c.tokens.val_check_interval >= 1,
        lambda c: (
            "must be >= 1 (steps between evaluations) or -1 (only at the end), "
            f"got {c.tokens.val_check_interval}"
        ),
    ),
    Check(
        "tokens.limit_val_batches",
        lambda c: c.tokens.limit_val_batches >= 0,
        lambda c: f"must be >= 0 (0 = the whole validation set), got {c.tokens.limit_val_batches}",
    ),
    Check(
        "tokens.limit_test_batches",
        lambda c: c.tokens.limit_test_batches == 0,
        "must be 0: there is no test split (evaluate a checkpoint on any folder with "
        "python -m nanotron_train.evaluate)",
    ),
    _needs_section("val_check_interval", -1),
    _needs_section("limit_val_batches", 0),
    Check(
        "validation",
        lambda c: (
            c.validation is None or (c.validation.dataset is None) != (c.validation.split is None)
        ),
        "give exactly one of validation.dataset (a held-out folder or blend) or "
        "validation.split (a fraction of the training documents)",
    ),
    Check(
        "validation.split",
        lambda c: (
            not _split(c)
            or (not isinstance(c.validation.split, bool) and 0.0 < c.validation.split < 1.0)
        ),
        lambda c: f"must be a fraction of documents in (0, 1), got {c.validation.split}",
    ),
    Check(
        "validation.split",
        lambda c: not _split(c) or any(s.data.dataset is not None for s in c.data_stages),
        "needs real training data (data_stages[].data.dataset); synthetic data has no "
        "documents to hold out, use validation.dataset",
    ),
    Check(
        "validation.dataset.dataset_folder",
        lambda c: not _folder(c) or _sft(c) or bool(c.validation.dataset.dataset_folder),
        "give the tokenized folder(s) to evaluate on (or held-out conversations: "
        "hf_dataset_or_datasets with sft_dataloader: true)",
    ),
    Check(
        "validation.dataset.hf_dataset_or_datasets",
        lambda c: not _sft(c) or bool(c.validation.dataset.hf_dataset_or_datasets),
        "give the held-out conversations (a JSONL file or folder) to evaluate on",
    ),
    Check(
        lambda c: f"validation.dataset.{_unused_key(c)}",
        lambda c: not _folder(c) or _unused_key(c) is None,
        lambda c: f"is not used by validation (only {_names(_USED_SFT if _sft(c) else _USED)} are)",
    ),
)
