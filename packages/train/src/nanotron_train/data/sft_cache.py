"""SFT examples read, templated, tokenized and packed once into ``cache_dir/sft-<key>/``, then
reused by later runs and by every rank (data/sft.py's rows, as cache.py does for pretraining).

The key hashes everything the rows depend on: the content (sha256) of each example file in
read order, the tokenizer.json's sha256, the chat template's text (the config's or the
tokenizer's; none for prompt/completion rows), `debug_max_samples`, the sequence length,
whether conversations are packed (document masking) or one a row, the format version and the
source of the modules that build the rows (an edit of the rendering or packing code builds
again, instead of serving rows the code no longer makes). Data copied elsewhere reuses its
cache; any change builds under a new key.

The builder rank computes the key (reading every data file) and shares it through the store:
the other ranks read no data file. It writes the arrays (one .npy each) and ``sft.json`` into
a hidden temporary folder renamed into place at the end; with `dataset_overwrite_cache` the
old folder of the same key is moved aside only then and removed, so one key never leaves two
folders. The other ranks wait on the barrier, as for the token cache, and every rank
memory-maps the finished arrays (one copy in the page cache, however many ranks a node runs).
Sharing the key also means every rank maps the builder's rows, even were its own view of the
files different.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanotron_train.data.cache import await_builder, post_failure
from nanotron_train.data.errors import DataError
from nanotron_train.data.tokenizer import file_sha256

FORMAT_VERSION = 1
META_FILE = "sft.json"
Rows = dict[str, np.ndarray]
# the modules whose code decides the rows: reading, rendering and masking, packing
BUILDERS = ("sft.py", "chat.py", "documents.py", "sft_cache.py")


@functools.cache
def builders_sha256() -> str:
    digest = hashlib.sha256()
    for name in BUILDERS:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class SFTCache:
    """Where SFT rows are cached and who builds them (`barrier`: source.py's BuilderBarrier;
    `share`: its share, the key computed by the builder alone; without one, by each rank)."""

    cache_dir: str
    is_builder: bool = True
    barrier: Callable[[str | None], str | None] | None = None
    overwrite: bool = False  # dataset_overwrite_cache: build again even when cached
    share: Callable[[Callable[[], str]], str] | None = None

    def key(self, compute: Callable[[], str]) -> str:
        """The rows' key: `compute()` on the builder, shared with the others when it can be."""
        return compute() if self.share is None else self.share(compute)


def sft_cache_key(
    files: list[Path],
    tokenizer_sha256: str,
    template: str | None,
    limit: int | None,
    sequence_length: int,
    packed: bool,
) -> str:
    blob = json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "files_sha256": [file_sha256(f) for f in files],
            "tokenizer_sha256": tokenizer_sha256,
            "chat_template": template,
            "debug_max_samples": limit,
            "sequence_length": sequence_length,
            "packed": packed,
            "code_sha256": builders_sha256(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_rows(
    cache: SFTCache, key: str, build: Callable[[], tuple[Rows, int]]
) -> tuple[Rows, dict, bool]:
    """(the rows of `key`, their sft.json, whether this call built them); `build()` returns
    (rows, number of examples) and runs on the builder rank when the cache lacks the key."""
    folder = Path(cache.cache_dir) / f"sft-{key}"
    built = False
    if cache.is_builder and (cache.overwrite or not (folder / META_FILE).is_file()):
        try:
            rows, examples = build()
            _write(folder, rows, examples, cache.overwrite)
            built = True
        except Exception as exc:
            post_failure(cache.barrier, exc)
            raise
    await_builder(folder, META_FILE, cache.barrier, cache.is_builder, "SFT data cache")
    rows, meta = _read(folder)
    return rows, meta, built


def _write(folder: Path, rows: Rows, examples: int, overwrite: bool) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, array in rows.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(array))
        meta = {
            "format_version": FORMAT_VERSION,
            "arrays": sorted(rows),
            "examples": examples,
            "rows": len(rows["input_ids"]),
            "labelled_tokens": int(rows["label_mask"].sum()),
            "max_token_id": int(rows["input_ids"].max(initial=0)),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))  # last: marks it complete
        _publish(tmp, folder, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # left only when publishing failed


def _publish(tmp: Path, folder: Path, overwrite: bool) -> None:
    """Rename `tmp` to `folder`; an old `folder` is moved aside only now (`overwrite`)."""
    old = None
    if folder.exists():
        if not overwrite:
            return  # another run published the same key meanwhile: the same rows
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.rename(folder, old)
    try:
        os.rename(tmp, folder)
    except OSError:
        if not (folder / META_FILE).is_file():
            raise
        # another run published the same key between the two renames: the same rows
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _read(folder: Path) -> tuple[Rows, dict]:
    try:
        meta = json.loads((folder / META_FILE).read_text())
        rows = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in meta["arrays"]}
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(
            f"{folder}: unreadable SFT data cache ({exc}); set dataset_overwrite_cache: true "
            "to build it again"
        ) from None
    return rows, meta
