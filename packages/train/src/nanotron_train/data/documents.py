"""Document boundaries of packed samples, as the model's document masking reads them.

Position ids restart at 0 at each document (Nanotron's `return_positions`); document ids
number the documents of a row from its first token (`nanotron_models.masks.document_ids`,
here on the host in numpy, where the data is made). Under context parallel the ids stay
whole-sequence (`split_batch` does not slice them) so every rank's mask sees every document.
"""

from __future__ import annotations

import numpy as np

from nanotron_models.masks import DOCUMENT_IDS_KEY

__all__ = ["DOCUMENT_IDS_KEY", "document_ids", "packed_positions"]


def document_ids(positions: np.ndarray) -> np.ndarray:
    """[b, S] int64 document index of each token from positions restarting at 0."""
    starts = positions == 0
    starts[:, 0] = True
    return np.cumsum(starts, axis=1, dtype=np.int64)


def packed_positions(lengths: list[int]) -> np.ndarray:
    """Positions [sum(lengths)] of documents of these lengths packed one after another."""
    return np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
