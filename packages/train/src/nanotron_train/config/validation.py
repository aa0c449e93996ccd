"""Config of held-out evaluation: the `validation` section and Nanotron's `tokens` keys for it.

- `validation.dataset`: a separate Nanoset folder or blend, with the keys of
  `data_stages[].data.dataset` (`dataset_folder`, `dataset_weights`, `eod_mask_loss`);
- `validation.split`: the fraction of documents of every training folder held out instead;
- `tokens.val_check_interval` (Nanotron): steps between evaluations; -1 = only at the end;
- `tokens.limit_val_batches` (Nanotron): validation batches (global batches) per evaluation;
  0 = the whole validation set.

Kept out of config.py (which calls `validate_validation`), like perf_config.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanotron_train.config.loader import ConfigError
from nanotron_train.data.stages import DatasetSpec

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config


@dataclass
class ValidationArgs:
    dataset: DatasetSpec | None = None  # dataset_folder and dataset_weights, as in training
    split: float | None = None  # fraction of each training folder's documents held out


def _check(cond: bool, key: str, message: str, source: str) -> None:
    if not cond:
        raise ConfigError(key, message, source)


def validate_validation(cfg: Config, source: str) -> None:
    tok, val = cfg.tokens, cfg.validation
    _check(
        tok.val_check_interval == -1 or tok.val_check_interval >= 1,
        "tokens.val_check_interval",
        f"must be >= 1 (steps between evaluations) or -1 (only at the end), "
        f"got {tok.val_check_interval}",
        source,
    )
    _check(
        tok.limit_val_batches >= 0,
        "tokens.limit_val_batches",
        f"must be >= 0 (0 = the whole validation set), got {tok.limit_val_batches}",
        source,
    )
    _check(
        tok.limit_test_batches == 0,
        "tokens.limit_test_batches",
        "must be 0: there is no test split (evaluate a checkpoint on any folder with "
        "python -m nanotron_train.evaluate)",
        source,
    )
    if val is None:
        for key, default in (("val_check_interval", -1), ("limit_val_batches", 0)):
            _check(
                getattr(tok, key) == default,
                f"tokens.{key}",
                "needs a validation section (validation.dataset or validation.split) to "
                "evaluate on",
                source,
            )
        return
    _check(
        (val.dataset is None) != (val.split is None),
        "validation",
        "give exactly one of validation.dataset (a held-out folder or blend) or "
        "validation.split (a fraction of the training documents)",
        source,
    )
    if val.split is not None:
        _check(
            not isinstance(val.split, bool) and 0.0 < val.split < 1.0,
            "validation.split",
            f"must be a fraction of documents in (0, 1), got {val.split}",
            source,
        )
        _check(
            any(s.data.dataset is not None for s in cfg.data_stages),
            "validation.split",
            "needs real training data (data_stages[].data.dataset); synthetic data has no "
            "documents to hold out, use validation.dataset",
            source,
        )
        return
    spec = val.dataset
    _check(
        bool(spec.dataset_folder),
        "validation.dataset.dataset_folder",
        "give the tokenized folder(s) to evaluate on",
        source,
    )
    defaults = DatasetSpec()
    for f in dataclasses.fields(DatasetSpec):
        if f.name in ("dataset_folder", "dataset_weights", "eod_mask_loss"):
            continue
        _check(
            getattr(spec, f.name) == getattr(defaults, f.name),
            f"validation.dataset.{f.name}",
            "is not used by validation (only dataset_folder, dataset_weights and eod_mask_loss "
            "are)",
            source,
        )
