"""Raw local datasets tokenized once into ``cache_dir/<hash>/``, by the builder rank only.

The folder name hashes everything the tokens depend on: each input file's path, size and
modification time, the text column and the tokenizer's sha256. The builder tokenizes (the
write is atomic), the other ranks wait on the barrier and then open the finished folder. The
barrier carries the builder's outcome: when building fails, the other ranks fail at once with
the builder's message instead of waiting for a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from nanotron_train.data.errors import DataError
from nanotron_train.data.nanoset import FORMAT_VERSION, METADATA_FILE
from nanotron_train.data.readers import expand_inputs, source_files
from nanotron_train.data.tokenize import tokenize_to_nanoset
from nanotron_train.data.tokenizer import file_sha256, load_tokenizer

WAIT_TIMEOUT_S = 6 * 3600


def cache_key(
    inputs: list[str] | str,
    text_column: str,
    tokenizer_file: str,
    splits: list[str] | None = None,
    identity: str | None = None,
) -> str:
    """`identity`: what stands for the inputs in the key instead of their files' stats (a
    dataset mix's own key: its saved files get new times each time it is rebuilt, and the
    tokens would then pile up under a new key per run)."""
    parts: list | str = identity or []
    if identity is None:
        for src in expand_inputs(inputs):
            for f in source_files(src):
                st = f.stat()
                parts.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    blob = json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "inputs": parts,
            "text_column": text_column,
            "tokenizer_sha256": file_sha256(tokenizer_file),
            **({"splits": splits} if splits is not None else {}),  # old keys stay valid
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_nanoset(
    inputs: list[str] | str,
    *,
    tokenizer_path: str | None,
    cache_dir: str | os.PathLike,
    text_column: str = "text",
    is_builder: bool = True,
    barrier: Callable[[str | None], str | None] | None = None,
    num_workers: int | None = None,
    splits: list[str] | None = None,
    overwrite: bool = False,
    identity: str | None = None,
) -> Path:
    """The Nanoset folder for a raw local dataset, building it on first use (`overwrite`:
    building it again even when cached, in the same folder; `splits`: of a saved
    DatasetDict; `identity`: see cache_key).

    `barrier(error)`: the builder posts its outcome (None = built), every other rank waits for
    it and gets the builder's error back (or None).
    """
    if tokenizer_path is None:
        raise DataError(
            f"hf_dataset_or_datasets {inputs!r}: tokenizer.tokenizer_name_or_path is needed to "
            "tokenize it"
        )
    tok = load_tokenizer(tokenizer_path)
    folder = Path(cache_dir) / cache_key(inputs, text_column, tok.path, splits, identity)
    if is_builder and (overwrite or not (folder / METADATA_FILE).is_file()):
        try:
            tokenize_to_nanoset(
                inputs, tok.path, folder, text_column=text_column, num_workers=num_workers,
                splits=splits, overwrite=overwrite,
            )  # fmt: skip
        except Exception as exc:
            post_failure(barrier, exc)
            raise
    await_builder(folder, METADATA_FILE, barrier, is_builder, "data cache")
    return folder


def failure_text(exc: Exception) -> str:
    """The builder's failure as the waiting ranks say it (a DataError is already a sentence)."""
    return str(exc) if isinstance(exc, DataError) else f"{type(exc).__name__}: {exc}"


def post_failure(barrier: Callable[[str | None], str | None] | None, exc: Exception) -> None:
    """The builder's failure posted on `barrier`: the others stop waiting and fail with it."""
    if barrier is not None:
        barrier(failure_text(exc))


def await_builder(
    folder: Path,
    marker: str,
    barrier: Callable[[str | None], str | None] | None,
    is_builder: bool,
    what: str,
) -> None:
    """Every rank but the builder waits until `folder` is built: on the barrier (which carries
    the builder's error, raised here), else by polling for `marker`, written last."""
    if barrier is not None:
        error = barrier(None)
        if error and not is_builder:
            raise DataError(f"the rank building the {what} {folder} failed: {error}")
    elif not is_builder:  # no barrier given: poll for the builder's atomic rename
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while not (folder / marker).is_file():
            if time.monotonic() > deadline:
                raise DataError(f"{folder}: timed out waiting for the builder rank")
            time.sleep(1.0)
