"""The Nanoset on-disk format: a flat token array, document end offsets and metadata.

A Nanoset folder holds
- ``tokens.bin``: every document's tokens back to back, each document followed by EOS,
  as uint16 (vocab <= 65536) or uint32; read through ``np.memmap``, never loaded whole;
- ``doc_ends.npy``: int64 end offset (exclusive, after the EOS) of each document;
- ``metadata.json``: format_version, tokenizer {path, sha256}, vocab_size, dtype,
  num_tokens, num_documents, eos_token_id.

Writing goes to a hidden temporary folder next to the target that is renamed at the end,
so an interrupted write never leaves anything that looks like a complete Nanoset.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from nanotron_train.data.errors import DataError

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
DOC_ENDS_FILE = "doc_ends.npy"
METADATA_FILE = "metadata.json"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id of a vocab of this size."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


@dataclass
class NanosetMetadata:
    format_version: int
    tokenizer: dict  # {"path": str, "sha256": str}
    vocab_size: int
    dtype: str
    num_tokens: int
    num_documents: int
    eos_token_id: int

    @classmethod
    def from_file(cls, path: Path) -> NanosetMetadata:
        if not path.is_file():
            raise DataError(f"{path}: missing Nanoset metadata (is this a Nanoset folder?)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: corrupt Nanoset metadata ({exc})") from None
        if not isinstance(raw, dict):
            raise DataError(f"{path}: corrupt Nanoset metadata (not a JSON object)")
        fields = cls.__dataclass_fields__
        missing = sorted(set(fields) - set(raw))
        if missing:
            raise DataError(f"{path}: corrupt Nanoset metadata, missing keys {missing}")
        meta = cls(**{k: raw[k] for k in fields})
        if meta.format_version != FORMAT_VERSION:
            raise DataError(
                f"{path}: Nanoset format_version {meta.format_version} is not supported "
                f"(this reader knows {FORMAT_VERSION})"
            )
        if meta.dtype not in ("uint16", "uint32"):
            raise DataError(f"{path}: dtype {meta.dtype!r} must be uint16 or uint32")
        for key in ("vocab_size", "num_tokens", "num_documents", "eos_token_id"):
            value = getattr(meta, key)
            if not isinstance(value, int) or value < 0:
                raise DataError(f"{path}: {key} must be a non-negative integer, got {value!r}")
        return meta


class Nanoset:
    """A read-only, memory-mapped Nanoset folder, validated when opened."""

    def __init__(self, folder: str | os.PathLike, model_vocab_size: int | None = None):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise DataError(f"{self.folder}: Nanoset folder does not exist")
        meta_path = self.folder / METADATA_FILE
        self.metadata = NanosetMetadata.from_file(meta_path)
        self.dtype = np.dtype(self.metadata.dtype)
        tokens_path = self.folder / TOKENS_FILE
        if not tokens_path.is_file():
            raise DataError(f"{tokens_path}: missing Nanoset token file")
        expected = self.metadata.num_tokens * self.dtype.itemsize
        actual = tokens_path.stat().st_size
        if actual != expected:
            raise DataError(
                f"{tokens_path}: size {actual} bytes disagrees with {meta_path} "
                f"(num_tokens {self.metadata.num_tokens} x {self.dtype.itemsize} bytes = {expected})"
            )
        if model_vocab_size is not None and self.metadata.vocab_size > model_vocab_size:
            raise DataError(
                f"{meta_path}: tokenizer vocab_size {self.metadata.vocab_size} exceeds the "
                f"model's vocab_size {model_vocab_size}"
            )
        if self.metadata.num_tokens == 0:
            raise DataError(f"{tokens_path}: Nanoset holds no tokens")
        # A plain ndarray view of the memmap: the same pages, without np.memmap's per-slice
        # Python overhead (which costs ~20% of the read throughput on short samples).
        self.tokens = np.memmap(tokens_path, dtype=self.dtype, mode="r").view(np.ndarray)
        self._doc_ends_path = self.folder / DOC_ENDS_FILE
        self._doc_ends: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)  # = metadata num_tokens, unless dataset_max_tokens cut it

    @property
    def eos_token_id(self) -> int:
        return self.metadata.eos_token_id

    @property
    def doc_ends(self) -> np.ndarray:
        """Document end offsets, loaded (and checked) on first use."""
        if self._doc_ends is None:
            path = self._doc_ends_path
            try:
                ends = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise DataError(f"{path}: missing or corrupt document index ({exc})") from None
            if ends.ndim != 1 or len(ends) != self.metadata.num_documents:
                raise DataError(
                    f"{path}: {len(ends)} document ends disagree with num_documents "
                    f"{self.metadata.num_documents} in {self.folder / METADATA_FILE}"
                )
            if len(ends) and int(ends[-1]) != self.metadata.num_tokens:
                raise DataError(f"{path}: last document end {int(ends[-1])} != num_tokens")
            self._doc_ends = ends
        return self._doc_ends

    def document(self, index: int) -> np.ndarray:
        """The tokens of one document, its trailing EOS included."""
        ends = self.doc_ends
        start = 0 if index == 0 else int(ends[index - 1])
        return np.asarray(self.tokens[start : int(ends[index])])

    def num_samples(self, sequence_length: int) -> int:
        """Samples are tokens [i*S, i*S + S + 1): consecutive samples share one token."""
        return (self.num_tokens - 1) // sequence_length

    def sample(self, index: int, sequence_length: int) -> np.ndarray:
        start = index * sequence_length
        return self.tokens[start : start + sequence_length + 1]


class NanosetWriter:
    """Appends documents to a temporary folder; ``finish()`` renames it into place."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        vocab_size: int,
        eos_token_id: int,
        tokenizer_path: str,
        tokenizer_sha256: str,
        overwrite: bool = False,
    ):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not overwrite:
            raise DataError(f"{self.out_dir}: already exists (pass --overwrite to replace it)")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_dir = self.out_dir.parent / f".{self.out_dir.name}.tmp-{os.getpid()}"
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir()
        self.dtype = dtype_for_vocab(vocab_size)
        self._meta = dict(
            format_version=FORMAT_VERSION,
            tokenizer={"path": tokenizer_path, "sha256": tokenizer_sha256},
            vocab_size=vocab_size,
            dtype=self.dtype.name,
            eos_token_id=eos_token_id,
        )
        self._tokens = open(self.tmp_dir / TOKENS_FILE, "wb")  # noqa: SIM115 (closed in finish/abort)
        self._ends: list[int] = []
        self.num_tokens = 0

    def add_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Documents back to back (EOS already appended to each) and their lengths."""
        self._tokens.write(np.asarray(ids, dtype=self.dtype).tobytes())
        ends = self.num_tokens + np.cumsum(lengths, dtype=np.int64)
        self._ends.extend(ends.tolist())
        self.num_tokens += int(np.sum(lengths))

    def finish(self) -> Path:
        self._tokens.flush()
        os.fsync(self._tokens.fileno())
        self._tokens.close()
        np.save(self.tmp_dir / DOC_ENDS_FILE, np.asarray(self._ends, dtype=np.int64))
        meta = NanosetMetadata(
            **self._meta, num_tokens=self.num_tokens, num_documents=len(self._ends)
        )
        # Metadata last: a folder with metadata.json is complete.
        with open(self.tmp_dir / METADATA_FILE, "w", encoding="utf-8") as f:
            json.dump(asdict(meta), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if self.out_dir.exists():  # --overwrite: move the old one aside only now
            old = self.out_dir.parent / f".{self.out_dir.name}.old-{os.getpid()}"
            os.rename(self.out_dir, old)
            shutil.rmtree(old)
        try:
            os.rename(self.tmp_dir, self.out_dir)
        except OSError:
            if not (self.out_dir / METADATA_FILE).is_file():
                raise
            # Another process finished the same folder first (e.g. two cache builders).
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return self.out_dir

    def abort(self) -> None:
        if not self._tokens.closed:
            self._tokens.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
