"""A training config's inputs, settled before any worker starts: paths made absolute, dataset
folders present, special token ids compared with the tokenizer's.

`python -m nanotron_train` (every rank) and `python -m nanotron_train.launch` (before spawning)
call `prepare_for_training` right after loading the config:

1. Relative input paths (the tokenizer, dataset folders, their read paths, raw datasets) are
   resolved against the working directory, so the config a checkpoint stores holds absolute
   paths and `generate`, `convert to-hf` and `evaluate` work from any folder.
2. A dataset folder that exists neither where it is named nor at its `dataset_read_path` is
   one error naming its key and the config file, at once (not after the workers started).
3. With a tokenizer readable here, a `model.model_config.{bos,eos,pad}_token_id` that is not
   one of its special tokens trains, with one warning (token_ids.py) handed to `warn`: the
   callers give it to one process only. An unreadable tokenizer is left to the data path,
   which needs it only for real data (a synthetic run may name a tokenizer it never reads).
4. `evaluation.include_path` folders present (made absolute); Nanotron's `lighteval` keys
   with no meaning here: one warning (config/evaluation.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nanotron_train.config.errors import ConfigError


def config_source(config_file: str, flags: Sequence[str] = ()) -> str:
    """The name a run's errors and warnings give its config: the file, and the command-line
    flags that changed it, e.g. `c.yaml (with --override, --auto)`. Named flag by flag:
    --auto and --resume are overrides underneath, but a line must not name one not given."""
    return f"{config_file} (with {', '.join(flags)})" if flags else str(config_file)


def prepare_for_training(cfg: Any, source: str, warn: Callable[[str], None] | None = None) -> Any:
    """`cfg` with absolute input paths, checked (ConfigError naming the key and `source`, the
    config's name from config_source); `warn` gets each warning line (none are made without
    it)."""
    tok = cfg.tokenizer
    if tok.tokenizer_name_or_path and Path(tok.tokenizer_name_or_path).expanduser().exists():
        tok.tokenizer_name_or_path = _absolute(tok.tokenizer_name_or_path)
    for i, stage in enumerate(cfg.data_stages):
        _settle_dataset(stage.data.dataset, f"data_stages.{i}.data.dataset", source)
    if cfg.validation is not None:
        _settle_dataset(cfg.validation.dataset, "validation.dataset", source)
    if cfg.evaluation is not None:
        _settle_task_folders(cfg.evaluation, source)
    if warn is not None:
        _warn_token_ids(cfg, source, warn)
        from nanotron_train.config.evaluation import evaluation_warnings

        for line in evaluation_warnings(cfg):  # Nanotron's lighteval keys that do not map
            warn(f"warning: {source}: {line}")
    return cfg


def _settle_task_folders(evaluation: Any, source: str) -> None:
    """`evaluation.include_path`: folders that exist, made absolute (the separate job reads
    them from the checkpoint's config, from its own working directory)."""
    for j, folder in enumerate(evaluation.include_path):
        if not Path(folder).expanduser().is_dir():
            raise ConfigError(
                f"evaluation.include_path.{j}",
                f"{folder}: no such folder of task YAMLs, seen from {os.getcwd()}",
                source,
            )
    evaluation.include_path = [_absolute(f) for f in evaluation.include_path]


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _settle_dataset(ds: Any, key: str, source: str) -> None:
    if ds is None:
        return
    raw = ds.hf_dataset_or_datasets
    if isinstance(raw, str) and raw and Path(raw).expanduser().exists():
        ds.hf_dataset_or_datasets = _absolute(raw)
    elif isinstance(raw, dict):  # Nanotron's mixer {input: fraction}: its inputs likewise
        ds.hf_dataset_or_datasets = {
            _absolute(k) if Path(str(k)).expanduser().exists() else k: v for k, v in raw.items()
        }
    if ds.dataset_read_path is not None:
        ds.dataset_read_path = [_absolute(p) for p in ds.dataset_read_path]
    folders = list(ds.dataset_folder or [])
    reads = list(ds.dataset_read_path or [None] * len(folders))
    for j, (folder, read) in enumerate(zip(folders, reads, strict=False)):
        if not Path(folder).expanduser().exists() and not (read and Path(read).exists()):
            where = f"{key}.dataset_folder" + (f".{j}" if len(folders) > 1 else "")
            also = f" (nor its dataset_read_path {read})" if read else ""
            raise ConfigError(
                where,
                f"{folder}: no such folder{also}, seen from {os.getcwd()}; tokenize one with "
                "`python -m nanotron_train.data tokenize`",
                source,
            )
    ds.dataset_folder = [_absolute(f) for f in folders] if ds.dataset_folder else ds.dataset_folder


def _warn_token_ids(cfg: Any, source: str, warn: Callable[[str], None]) -> None:
    from nanotron_train.config.token_ids import token_id_warning
    from nanotron_train.data import DataError, load_tokenizer

    tok_args = cfg.tokenizer
    if not tok_args.tokenizer_name_or_path:
        return
    try:
        tok = load_tokenizer(tok_args.tokenizer_name_or_path, tok_args.tokenizer_revision)
    except DataError:
        return
    line = token_id_warning(cfg.model.model_config, tok)
    if line is not None:
        warn(f"warning: {source}: {line}")
