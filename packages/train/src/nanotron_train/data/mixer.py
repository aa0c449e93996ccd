"""Nanotron's dataset mixer: ``hf_dataset_or_datasets: {dataset: fraction, ...}``.

Nanotron (src/nanotron/data/processing.py, ``_get_dataset_mix``) loads each dataset's train
split, keeps its first ``int(fraction * len(split))`` rows, concatenates the parts in the
mapping's order and shuffles the result with ``shuffle(seed=42)``. Here each key is a local
input (files, a folder, a glob or a saved dataset, as the string form) and the mixed rows are
saved once as a dataset under ``cache_dir/mix-<hash>``, which is then tokenized as any other.

Nanotron's rules kept: a negative fraction and an empty mapping fail; every split must name
"train" or "test" (test splits are loaded and unused by its training run, so unused here);
``hf_dataset_config_name`` is not passed. Refused where Nanotron's run would be wrong: a
fraction above 1 (``select`` past the end fails), a non-number, and more than one train
split (its fractions then pair with the wrong datasets). A list is refused as Nanotron's
``get_datasets`` refuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanotron_train.data.errors import DataError
from nanotron_train.data.readers import expand_inputs, iter_documents, source_files

SHUFFLE_SEED = 42  # Nanotron's _get_dataset_mix default
MIX_MARKER = "mix.json"
WAIT_TIMEOUT_S = 6 * 3600


def _train_split(splits: list[str] | None) -> tuple[str | None, str | None]:
    """(the one train split of `splits`, None) (Nanotron's default: train), or (None, why)."""
    splits = splits or ["train"]
    bad = [s for s in splits if "train" not in s and "test" not in s]
    if bad:
        return None, f"split {bad[0]!r} is neither a train nor a test split (Nanotron's mixer)"
    train = [s for s in splits if "train" in s]
    if len(train) != 1:
        return None, f"a dataset mapping reads exactly one train split, got {train}"
    return train[0], None


def mixer_error(value: Any, splits: list[str] | None) -> str | None:
    """Why `value` (hf_dataset_or_datasets) is refused as Nanotron's runs would fail or be
    wrong; None when it is a string or a valid mixer."""
    if isinstance(value, list):
        return (
            "a list of datasets is refused by Nanotron's get_datasets too: give a mapping "
            "{dataset: fraction}, fraction 1.0 to take all of one"
        )
    if not isinstance(value, dict):
        return None
    if not value:
        return "the dataset mapping is empty"
    for name, frac in value.items():
        if not isinstance(frac, int | float) or isinstance(frac, bool):
            return f"{name}: fraction {frac!r} is not a number"
        if not 0 <= frac <= 1:
            return f"{name}: fraction {frac} outside [0, 1] (the share of its rows kept)"
    return _train_split(splits)[1]


def mix_key(mix: dict[str, float], split: str, text_column: str) -> str:
    parts = []
    for name, frac in mix.items():
        files = [
            [str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
            for src in expand_inputs(name)
            for f in source_files(src)
        ]
        parts.append([name, float(frac), files])
    blob = json.dumps({"mix": parts, "split": split, "text_column": text_column})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _train_rows(name: str, split: str, column: str) -> Any:
    """One dataset's train split as a `datasets.Dataset` of `column` (rows as Nanotron counts
    them: a saved dataset's rows, empty ones included; a file's documents)."""
    import datasets

    sources = expand_inputs(name)
    if len(sources) == 1 and sources[0].kind == "hf":
        loaded = datasets.load_from_disk(str(sources[0].path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{name}: no split {split!r} (splits: {sorted(loaded)})")
            loaded = loaded[split]
        if column not in loaded.column_names:
            raise DataError(f"{name}: no column {column!r} (columns: {loaded.column_names})")
        return loaded.select_columns([column])
    return datasets.Dataset.from_dict({column: list(iter_documents(sources, column, [split]))})


def build_mix(mix: dict[str, float], split: str, column: str, folder: Path) -> None:
    """Nanotron's selection: first int(frac * n) rows each, concatenated, shuffled (seed 42)."""
    import datasets

    parts = []
    for name, frac in mix.items():
        rows = _train_rows(name, split, column)
        # keep_in_memory: no index cache files written into the user's dataset folders
        parts.append(rows.select(range(int(frac * len(rows))), keep_in_memory=True))
    mixed = datasets.concatenate_datasets(parts).shuffle(seed=SHUFFLE_SEED, keep_in_memory=True)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    mixed.save_to_disk(str(tmp / "data"))
    (tmp / MIX_MARKER).write_text(json.dumps({"mix": mix, "split": split, "rows": len(mixed)}))
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    if folder.exists():  # dataset_overwrite_cache: the old mix moved aside only now
        os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def mixed_dataset(
    mix: dict[str, float],
    *,
    splits: list[str] | None,
    text_column: str,
    cache_dir: str | os.PathLike,
    is_builder: bool = True,
    barrier: Callable[[str | None], str | None] | None = None,
    overwrite: bool = False,
) -> Path:
    """The saved mixed dataset (a folder to tokenize), built by the builder rank; the others
    wait on `barrier` (or poll) as for the token cache (cache.py)."""
    error = mixer_error(mix, splits)
    if error:
        raise DataError(f"hf_dataset_or_datasets: {error}")
    split = _train_split(splits)[0]
    assert split is not None  # mixer_error checked it
    folder = Path(cache_dir) / f"mix-{mix_key(mix, split, text_column)}"
    if is_builder and (overwrite or not (folder / MIX_MARKER).is_file()):
        try:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            build_mix(mix, split, text_column, folder)
        except Exception as exc:
            if barrier is not None:
                barrier(str(exc) if isinstance(exc, DataError) else f"{type(exc).__name__}: {exc}")
            raise
    if barrier is not None:
        error = barrier(None)
        if error and not is_builder:
            raise DataError(f"the rank building the dataset mix {folder} failed: {error}")
    elif not is_builder:
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while not (folder / MIX_MARKER).is_file():
            if time.monotonic() > deadline:
                raise DataError(f"{folder}: timed out waiting for the builder rank")
            time.sleep(1.0)
    return folder / "data"
