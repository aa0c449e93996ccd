"""``ValidationData``: the fixed held-out batches that every evaluation of a run measures.

The validation set is every sample (``sequence_length + 1`` tokens, cut like the training
samples) of its Nanosets: a separate folder or blend (``validation.dataset``), or the held-out
documents of the training folders (``validation.split``, see split.py). Its order is fixed by
the data alone (seed ``VALIDATION_SEED``, not the run's), so runs with different seeds and
every evaluation of one run measure the same batches:

- without ``dataset_weights``: one seeded permutation of all samples of all folders, so the
  whole set is each sample exactly once and a prefix is a proportional sample of the folders;
- with ``dataset_weights``: the training blend (blend.py) draws the folders by weight, each
  folder's samples in its own seeded order.

A validation batch is one global batch of the run (``micro_batch_size *
batch_accumulation_per_replica * dp`` samples); ``tokens.limit_val_batches`` = B evaluates the
first B of them (0: the whole set). Batch b is samples [b*G, (b+1)*G) of the order and dp rank
r takes its contiguous slice, cut into micro-batches as in training, so the samples measured do
not depend on dp, tp or pp. The last batch is completed with padding rows whose label mask is
all false: they weigh nothing in the token-weighted mean. With ``eod_mask_loss`` the labels
after each document's last token are masked too, as in training (train_data.py).
"""

from __future__ import annotations

import math

import numpy as np

from nanotron_train.data.blend import blend_draw
from nanotron_train.data.datatrove import eod_label_mask, positions
from nanotron_train.data.documents import DOCUMENT_IDS_KEY, document_ids
from nanotron_train.data.errors import DataError
from nanotron_train.data.nanoset import Nanoset
from nanotron_train.data.sampler import ShuffledSamples

VALIDATION_SEED = 0


class ValidationData:
    def __init__(
        self,
        nanosets: list[Nanoset],
        weights: list[float] | None,
        *,
        sequence_length: int,
        micro_batch_size: int,
        batch_accumulation_per_replica: int,
        dp_rank: int,
        dp_size: int,
        limit_batches: int = 0,
        eod_mask_loss: bool = False,
        document_masking: bool = False,
    ) -> None:
        if not nanosets:
            raise DataError("validation: no dataset to evaluate on")
        if limit_batches < 0:
            raise DataError(f"tokens.limit_val_batches must be >= 0, got {limit_batches}")
        S = self.sequence_length = sequence_length
        self.nanosets = nanosets
        self.mbs, self.accum = micro_batch_size, batch_accumulation_per_replica
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.global_batch_size = micro_batch_size * batch_accumulation_per_replica * dp_size
        self.eod_mask_loss = eod_mask_loss
        self.document_masking = document_masking  # positions and document ids, as in training
        sizes = [ns.num_samples(S) for ns in nanosets]
        for ns, n in zip(nanosets, sizes):
            if n < 1:
                raise DataError(
                    f"validation: {ns.folder} ({getattr(ns, 'part', 'all')}, {ns.num_tokens} tokens) is too small "
                    f"for one sample of sequence_length + 1 = {S + 1} tokens"
                )
        whole = sum(sizes)
        n = whole if limit_batches == 0 else min(limit_batches * self.global_batch_size, whole)
        if weights is None:  # each sample once, in one seeded order over all folders
            order = np.random.default_rng(VALIDATION_SEED).permutation(whole)[:n]
            starts = np.cumsum([0, *sizes])
            self._dataset = np.searchsorted(starts, order, side="right") - 1
            self._sample = order - starts[self._dataset]
        else:
            self._dataset = np.asarray(blend_draw([0] * len(sizes), weights, n), dtype=np.int64)
            self._sample = np.empty(n, dtype=np.int64)
            for d, size in enumerate(sizes):
                rows = np.flatnonzero(self._dataset == d)
                sampler = ShuffledSamples(size, VALIDATION_SEED, d, str(nanosets[d].folder), False)
                self._sample[rows] = sampler.sample_ids(0, len(rows))
        self.num_samples = n
        self.num_batches = math.ceil(n / self.global_batch_size)

    def batches(self):
        """Yield, per validation batch, this dp rank's micro-batches and the number of labelled
        tokens in each (the weights of their mean losses)."""
        per_rank = self.mbs * self.accum
        for b in range(self.num_batches):
            first = b * self.global_batch_size + self.dp_rank * per_rank
            micro_batches = [
                self._collate(range(first + m * self.mbs, first + (m + 1) * self.mbs))
                for m in range(self.accum)
            ]
            yield micro_batches, [float(mb["label_mask"].sum()) for mb in micro_batches]

    def _collate(self, rows: range) -> dict:
        import torch

        S = self.sequence_length
        tokens = np.zeros((len(rows), S + 1), dtype=np.int64)
        mask = np.zeros((len(rows), S), dtype=bool)
        pos = np.tile(np.arange(S, dtype=np.int64), (len(rows), 1))
        for i, row in enumerate(rows):
            if row >= self.num_samples:
                continue  # padding of the last batch: masked out
            ns = self.nanosets[self._dataset[row]]
            start = int(self._sample[row]) * S
            tokens[i] = ns.tokens[start : start + S + 1]
            if self.document_masking:
                pos[i] = positions(ns.doc_ends, np.asarray([start]), S)[0]
            if self.eod_mask_loss:
                mask[i] = eod_label_mask(ns.doc_ends, np.asarray([start]), S)[0]
            else:
                mask[i] = True
        batch = {
            "input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
            "label_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, 1:])),
            "label_mask": torch.from_numpy(mask),
        }
        if self.document_masking:
            batch["position_ids"] = torch.from_numpy(pos)
            batch[DOCUMENT_IDS_KEY] = torch.from_numpy(document_ids(pos))
        return batch
