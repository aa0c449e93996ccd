"""Durable file writes and verified reads.

Writes hash the bytes in a helper thread while the main thread writes them (hashlib and file
writes both release the GIL), then fsync; reads do the same with `readinto`, straight into the
buffers that keep the bytes. So a checkpoint costs about one pass over the disk, not a write
plus a separate checksum pass.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nanotron_train.checkpoints.errors import CheckpointError

CHUNK = 16 * 2**20


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint, as listed in checkpoint_metadata.json (path relative)."""

    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


def _chunks(buffers: Iterable[memoryview]) -> Iterable[memoryview]:
    for buf in buffers:
        buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        for lo in range(0, len(buf), CHUNK):
            yield buf[lo : lo + CHUNK]


def write_durable(path: Path, buffers: Iterable[memoryview | bytes], root: Path) -> FileRecord:
    """Write the buffers to `path`, hashing on the side; fsync before returning."""
    digest = hashlib.sha256()
    size = 0
    views = (memoryview(b) for b in buffers)
    with open(path, "wb", buffering=0) as f, ThreadPoolExecutor(1) as hasher:
        # One worker runs the updates in submission order, so the digest is of the file.
        for chunk in _chunks(views):
            hasher.submit(digest.update, chunk)
            written = 0
            while written < len(chunk):
                written += f.write(chunk[written:])
            size += len(chunk)
        hasher.shutdown(wait=True)
        os.fsync(f.fileno())
    return FileRecord(str(path.relative_to(root)), size, digest.hexdigest())


def write_text_durable(path: Path, text: str, root: Path) -> FileRecord:
    return write_durable(path, [text.encode()], root)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def checked_size(path: Path, record: dict | None) -> int:
    """The file's size, checked against its metadata record when given."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing file") from None
    if record is not None:
        expected = int(record["size"])
        if actual < expected:
            raise CheckpointError(f"{path}: truncated ({actual} of {expected} bytes)")
        if actual != expected:
            raise CheckpointError(
                f"{path}: size mismatch ({actual} bytes, metadata says {expected})"
            )
    return actual


class VerifiedReader:
    """Reads a file front to back into caller-given buffers, hashing on the side.

    The caller picks where each run of bytes lands (a fresh buffer, or directly the tensor that
    will hold it), so a load needs no staging copy. One helper thread runs the sha256 updates
    in submission order (hashlib releases the GIL), overlapping the next read. `verify()` must
    be called once every byte has been read: it raises on a short file or a checksum mismatch.
    """

    def __init__(self, path: Path, record: dict | None) -> None:
        self.path, self.record = path, record
        self.size = checked_size(path, record)
        self.pos = 0
        self._digest = hashlib.sha256()
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 (closed in __exit__)
        self._hasher = ThreadPoolExecutor(1)

    def __enter__(self) -> VerifiedReader:
        return self

    def __exit__(self, *exc) -> None:
        self._hasher.shutdown(wait=True)
        self._file.close()

    def read_into(self, view: memoryview) -> None:
        """Fill `view` (1-D bytes) with the next len(view) bytes of the file."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        done = 0
        while done < len(view):
            n = self._file.readinto(view[done : done + CHUNK])
            if not n:
                raise CheckpointError(
                    f"{self.path}: truncated while reading ({self.pos} of {self.size} bytes)"
                )
            self._hasher.submit(self._digest.update, view[done : done + n])
            done += n
            self.pos += n

    def verify(self) -> None:
        if self.pos != self.size:
            raise CheckpointError(
                f"{self.path}: size changed while reading ({self.pos} of {self.size} bytes)"
            )
        self._hasher.shutdown(wait=True)  # every update done before the digest is read
        if self.record is not None and self._digest.hexdigest() != self.record["sha256"]:
            raise CheckpointError(
                f"{self.path}: checksum mismatch (sha256 differs from the metadata)"
            )


def read_verified(path: Path, record: dict | None) -> np.ndarray:
    """The whole file, checked against its metadata record (size, then sha256) when given."""
    with VerifiedReader(path, record) as reader:
        # Uninitialised (no zero-fill pass): every byte is overwritten by the read below.
        buf = torch.empty(reader.size, dtype=torch.uint8).numpy()
        reader.read_into(memoryview(buf))
        reader.verify()
    return buf
