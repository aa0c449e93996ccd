"""Reading files from places a trainer chose (its checkpoints path): capped, typed, cached.

Any ingester names the folder, so what lies there is hostile input: a 400 MB sparse file, a
FIFO that blocks a reader for ever, a device, a symlink to another user's file. A file is read
only if it is a regular file inside the folder (no symlink out of it), at most `max_bytes`,
opened without blocking; each is read once and its parsed result kept under its identity
(device, inode, mtime, size): a page view re-reads nothing that did not change.
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_METADATA_BYTES = 1 << 20  # checkpoint_metadata.json: real ones are a few KiB
Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_mtime_ns, st_size


class Refused(ValueError):
    """Not read: not a regular file, outside its folder, or over the cap."""


def read_capped(path: Path, root: Path, max_bytes: int) -> tuple[bytes, Identity]:
    """The bytes of `path` if it is a regular file of at most `max_bytes` under `root`."""
    try:
        real, base = path.resolve(), root.resolve()
    except (OSError, RuntimeError) as e:
        raise Refused(f"{path}: {e}") from None
    if not real.is_relative_to(base):
        raise Refused(f"{path}: resolves outside {root}")
    # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: no swap after resolve
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise Refused(f"{path}: {st.st_size} bytes, over the {max_bytes}-byte cap")
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        data = os.read(fd, max_bytes + 1)  # one read: a file that grew since fstat is cut off
        if len(data) > max_bytes:
            raise Refused(f"{path}: grew over the {max_bytes}-byte cap while read")
        return data, ident
    finally:
        os.close(fd)


class ParsedCache:
    """Parsed files by identity, LRU, bounded by the bytes of the files they came from."""

    def __init__(self, max_bytes: int = 8 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[Identity, tuple[Any, int]] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def identity(self, path: Path) -> Identity | None:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def get(self, path: Path, root: Path, parse: Callable[[bytes], Any], max_bytes: int) -> Any:
        """parse(bytes) of the file, from the cache when its identity is unchanged."""
        ident = self.identity(path)
        with self._lock:
            hit = self._items.get(ident) if ident else None
            if hit is not None:
                self._items.move_to_end(ident)
                return hit[0]
        data, ident = read_capped(path, root, max_bytes)
        value = parse(data)
        cost = 8 * len(data) + 512  # the parsed result, roughly, besides the bytes
        with self._lock:
            if ident not in self._items:
                self._items[ident] = (value, cost)
                self._total += cost
            while self._total > self.max_bytes and self._items:
                _, (_, c) = self._items.popitem(last=False)
                self._total -= c
        return value

    @property
    def nbytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._items)
