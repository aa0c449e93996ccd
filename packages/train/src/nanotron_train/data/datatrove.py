"""Folders tokenized by datatrove (what Nanotron's Nanoset reads), read in place.

datatrove's tokenizer writes, per task, `<name>.ds` (every document's tokens back to back,
little-endian uint16 or uint32), `<name>.ds.index` (uint64 end offset of each document in
that file) and, optionally, `<name>.ds.metadata` (first line `tokenizer_name|token_size`,
then the token count). A folder holds one or more such files; read in sorted name order (or
shuffled by the stage seed with `shuffle_files`) they are one token stream, which we sample
exactly as one of our Nanosets (samples of sequence_length + 1 tokens, shuffled, blended).

`open_tokenized_folder` tells the two formats apart: our `metadata.json`, else `*.ds` files.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nanotron_train.data.errors import DataError
from nanotron_train.data.nanoset import METADATA_FILE, Nanoset
from nanotron_train.data.tokenizer import tokenizer_file_sha256

DS_SUFFIX = ".ds"
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


@dataclass
class DatatroveMetadata:
    """What the folder says about itself, in the attributes TrainData reads of a Nanoset's."""

    tokenizer: dict = field(default_factory=dict)  # {"name": ...} from the .metadata files
    token_size: int = 2


class _ConcatTokens:
    """Several memory-mapped files as one read-only token array (slices only)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays
        self.starts = np.cumsum([0] + [len(a) for a in arrays]).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def head(self, n: int) -> _ConcatTokens:
        """The first n tokens, still without copying."""
        kept, left = [], n
        for a in self.arrays:
            if left <= 0:
                break
            kept.append(a[:left])
            left -= len(kept[-1])
        return _ConcatTokens(kept)

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, _ = index.indices(len(self))
        i = bisect.bisect_right(self.starts, start) - 1
        pieces = []
        while start < stop:
            a, offset = self.arrays[i], self.starts[i]
            end = min(stop, self.starts[i + 1])
            pieces.append(a[start - offset : end - offset])
            start, i = end, i + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def is_datatrove_folder(folder: str | os.PathLike) -> bool:
    path = Path(folder)
    return not (path / METADATA_FILE).is_file() and any(path.glob(f"*{DS_SUFFIX}"))


def _read_metadata(ds: Path) -> tuple[str, int] | None:
    meta = ds.with_name(ds.name + ".metadata")
    if not meta.is_file():
        return None
    first = meta.read_text(encoding="utf-8").splitlines()[0] if meta.stat().st_size else ""
    name, sep, size = first.rpartition("|")
    if not sep or not size.strip().isdigit():
        raise DataError(f"{meta}: first line must be 'tokenizer_name|token_size', got {first!r}")
    return name, int(size)


class DatatroveFolder:
    """A datatrove tokenized folder with the interface of our Nanoset (tokens, doc_ends,
    num_samples, sample)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        token_size: int | None = None,
        shuffle_files: bool = False,
        seed: int = 0,
    ) -> None:
        self.folder = Path(folder)
        files = sorted(self.folder.glob(f"*{DS_SUFFIX}"))
        if not files:
            raise DataError(f"{self.folder}: no datatrove .ds token files")
        if shuffle_files:  # Nanotron's shuffle_files: the files' order, from the seed
            files = [files[i] for i in np.random.RandomState(seed).permutation(len(files))]
        found = {m for m in (_read_metadata(f) for f in files) if m is not None}
        if len({size for _, size in found}) > 1 or len({name for name, _ in found}) > 1:
            raise DataError(f"{self.folder}: its .ds.metadata files disagree: {sorted(found)}")
        name, size = next(iter(found)) if found else (None, None)
        if size is not None and token_size is not None and size != token_size:
            raise DataError(
                f"{self.folder}: token_size_in_bytes is {token_size} but the folder's metadata "
                f"says {size}"
            )
        size = size or token_size
        if size not in DTYPES:
            raise DataError(
                f"{self.folder}: no .ds.metadata gives the token size: set "
                "dataset.token_size_in_bytes (2 or 4)"
            )
        self.metadata = DatatroveMetadata({"name": name} if name else {}, size)
        self.dtype = DTYPES[size]
        self.eos_token_id = None  # datatrove records document ends, not an EOS id
        arrays, ends, offset = [], [], 0
        for f in files:
            if f.stat().st_size % size:
                raise DataError(f"{f}: size {f.stat().st_size} is not a multiple of {size} bytes")
            arrays.append(np.memmap(f, dtype=self.dtype, mode="r").view(np.ndarray))
            index = f.with_name(f.name + ".index")
            if index.is_file():
                ends.append(np.fromfile(index, dtype="<u8").astype(np.int64) + offset)
            offset += len(arrays[-1])
        if offset == 0:
            raise DataError(f"{self.folder}: the .ds files hold no tokens")
        self.tokens = arrays[0] if len(arrays) == 1 else _ConcatTokens(arrays)
        self._doc_ends = np.concatenate(ends) if len(ends) == len(files) else None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def doc_ends(self) -> np.ndarray:
        if self._doc_ends is None:
            raise DataError(f"{self.folder}: some .ds files have no .ds.index (document ends)")
        return self._doc_ends

    num_samples = Nanoset.num_samples
    sample = Nanoset.sample


def open_tokenized_folder(folder: str | os.PathLike, spec, seed: int, model_vocab_size: int):
    """Our Nanoset or a datatrove folder, detected; checks the spec's tokenizer_name and
    token_size_in_bytes against what the folder records."""
    if is_datatrove_folder(folder):
        ns = DatatroveFolder(
            folder, token_size=spec.token_size_in_bytes, shuffle_files=spec.shuffle_files, seed=seed
        )
        recorded = ns.metadata.tokenizer.get("name")
    else:
        ns = Nanoset(folder, model_vocab_size=model_vocab_size)
        recorded = ns.metadata.tokenizer.get("path")
        if spec.token_size_in_bytes not in (None, ns.dtype.itemsize):
            raise DataError(
                f"{folder}: token_size_in_bytes is {spec.token_size_in_bytes} but its tokens are "
                f"{ns.dtype.name} ({ns.dtype.itemsize} bytes)"
            )
    if spec.tokenizer_name is not None and recorded is not None:
        check_tokenizer_name(folder, spec.tokenizer_name, recorded, ns.metadata.tokenizer)
    return ns


def check_tokenizer_name(folder, name: str, recorded: str, meta: dict) -> None:
    """`tokenizer_name` names the tokenizer the folder was tokenized with (`recorded`), however
    each is written (a folder and its tokenizer.json, a hub name and its cached file): the same
    string, or the same tokenizer.json content (the sha256 the metadata records, else that of
    the file the recorded name loads)."""
    if name == recorded:
        return
    mine = tokenizer_file_sha256(name)
    theirs = meta.get("sha256") or tokenizer_file_sha256(recorded)
    if mine is not None and mine == theirs:
        return
    if mine is None or theirs is None:
        missing = name if mine is None else recorded
        why = f"{missing!r} is not readable here to compare them by content"
    else:
        why = f"they are different tokenizers (sha256 {mine[:12]} and {theirs[:12]})"
    raise DataError(
        f"{folder}: tokenizer_name is {name!r} but the folder was tokenized with {recorded!r}, "
        f"and {why}"
    )


def keep_first_tokens(ns, n: int) -> None:
    """dataset_max_tokens: use only the first n tokens of the folder (Nanoset or datatrove)."""
    if n < ns.num_tokens:
        ns.tokens = ns.tokens.head(n) if isinstance(ns.tokens, _ConcatTokens) else ns.tokens[:n]


def eod_label_mask(doc_ends: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """eod_mask_loss: the label mask [len(starts), length] of the windows beginning at stream
    offsets `starts`: False at label position t when input token t is the last of a document
    (its target opens the next one). In our folders that token is the EOS after each document."""
    ends = starts[:, None] + np.arange(1, length + 1)[None, :]  # a document ending at t ends here
    found = np.searchsorted(doc_ends, ends)
    last = len(doc_ends) - 1
    return ~((found <= last) & (np.asarray(doc_ends)[np.minimum(found, last)] == ends))


def positions(doc_ends: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """Position ids [len(starts), length] that restart at 0 at each document start, for the
    windows of `length` tokens beginning at stream offsets `starts` (return_positions)."""
    t = starts[:, None] + np.arange(length)[None, :]
    doc = np.searchsorted(doc_ends, t, side="right")  # documents that ended at or before t
    doc_start = np.where(doc > 0, doc_ends[np.maximum(doc - 1, 0)], 0)
    return t - doc_start
