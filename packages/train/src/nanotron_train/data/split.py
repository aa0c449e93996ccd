"""Hold out documents of a Nanoset for validation (``validation.split``).

The last ``ceil(split * num_documents)`` documents of each folder are the validation part, the
others the training part, as Megatron-LM splits by document ranges. Training samples are cut
from the training part's tokens only (a sample is ``sequence_length + 1`` tokens, so the last
one ends at or before the first held-out token): no validation token is ever an input or a
label of training, in any epoch and whatever the layout, since the cut depends on the folder
and the fraction alone. A folder whose documents are ordered (by source, by date) puts that
order into the split: shuffle the documents before tokenizing if that is not wanted.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from nanotron_train.data.errors import DataError


def _token_range(tokens, start: int, end: int):
    """tokens[start:end] without copying: a memmap slice, or the pieces of a datatrove
    folder's concatenated files."""
    if isinstance(tokens, np.ndarray):
        return tokens[start:end]
    from nanotron_train.data.datatrove import _ConcatTokens

    kept = []
    for array, offset in zip(tokens.arrays, tokens.starts):
        lo, hi = max(start - offset, 0), min(end - offset, len(array))
        if lo < hi:
            kept.append(array[lo:hi])
    return kept[0] if len(kept) == 1 else _ConcatTokens(kept)


def part_of(ns, start: int, end: int, part: str):
    """The same folder (Nanoset or datatrove) restricted to tokens [start, end): `tokens`,
    `num_tokens` and the samples refer to the part, `folder` still names the whole."""
    view = copy.copy(ns)
    view.tokens = _token_range(ns.tokens, start, end)
    view.part = part
    ends = np.asarray(ns.doc_ends)  # the part's own document ends (eod_mask_loss, positions)
    view._doc_ends = ends[(ends > start) & (ends <= end)] - start
    return view


def check_split(split: float, where: str = "validation.split") -> None:
    if isinstance(split, bool) or not 0.0 < float(split) < 1.0:
        raise DataError(f"{where}: {split!r} must be a fraction of documents in (0, 1)")


def split_by_documents(ns, split: float, sequence_length: int):
    """(training part, validation part) of `ns`; each must hold at least one sample. Only
    whole documents count (dataset_max_tokens may have cut the last one)."""
    check_split(split)
    ends = np.asarray(ns.doc_ends)
    docs = int(np.searchsorted(ends, ns.num_tokens, side="right"))
    held_out = math.ceil(split * docs)
    if held_out >= docs:
        raise DataError(
            f"validation.split: {split} of the {docs} documents of {ns.folder} leaves no "
            "document for training"
        )
    boundary = int(ends[docs - held_out - 1])  # the first held-out token
    train = part_of(ns, 0, boundary, "train")
    val = part_of(ns, boundary, ns.num_tokens, "validation")
    for part, n_docs in ((train, docs - held_out), (val, held_out)):
        if part.num_samples(sequence_length) < 1:
            raise DataError(
                f"validation.split: the {part.part} part of {ns.folder} ({n_docs} documents, "
                f"{part.num_tokens} tokens) is too small for one sample of sequence_length + 1 "
                f"= {sequence_length + 1} tokens (an empty split)"
            )
    return train, val
