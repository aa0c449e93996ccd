"""Nanotron's tokenized data in datatrove's layout, written here from its documented format
(datatrove is not installed): test_nanotron_data.py reads it in place, other tests train on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def documents(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, 250, int(rng.integers(3, 30))), 0) for _ in range(count)]


def write_datatrove(folder: Path, files: list[list[np.ndarray]], tokenizer="org/tok", size=2):
    """datatrove's DocumentTokenizer output: per file `<name>.ds` (little-endian tokens),
    `.ds.index` (uint64 document ends within the file), `.ds.metadata` (name|size, count)."""
    folder.mkdir(parents=True)
    dtype = "<u2" if size == 2 else "<u4"
    for i, docs in enumerate(files):
        ds = folder / f"{i:05d}_shuffled.ds"
        tokens = np.concatenate(docs)
        tokens.astype(dtype).tofile(ds)
        np.cumsum([len(d) for d in docs]).astype("<u8").tofile(f"{ds}.index")
        if tokenizer is not None:
            Path(f"{ds}.metadata").write_text(f"{tokenizer}|{size}\n{len(tokens)}\n{len(tokens)}T")
    return folder
