"""The document boundaries the data gives the model's document masking: positions restarting at
each document and document ids, from a datatrove folder's document ends (a Nanoset's take the
same path) and from synthetic packed documents."""

from __future__ import annotations

import numpy as np
import torch

from nanotron_train.data import StageSpec, TrainData
from nanotron_train.data.stages import DatasetSpec
from nanotron_train.data.synthetic import SyntheticData
from tests.train.datatrove_writer import write_datatrove

SEQ = 16


def _expected(lengths: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions and document ids of the stream window [start, start + SEQ)."""
    pos = np.concatenate([np.arange(n) for n in lengths])[start : start + SEQ]
    ids = np.cumsum(np.where(np.arange(SEQ) == 0, True, pos == 0))
    return pos, ids


def test_datatrove_samples_carry_positions_and_document_ids(tmp_path):
    lengths = [5, 11, 3, 20, 7, 9, 14, 6, 12, 8]
    docs = [np.append(np.full(n - 1, 7 + i), 0) for i, n in enumerate(lengths)]
    folder = write_datatrove(tmp_path / "dt", [docs[:4], docs[4:]])
    spec = DatasetSpec(dataset_folder=[str(folder)], token_size_in_bytes=2, shuffle_files=False)
    td = TrainData([StageSpec("s", 1, spec, 5)], sequence_length=SEQ, micro_batch_size=2,
                   batch_accumulation_per_replica=1, dp_rank=0, dp_size=1, tokenizer_path=None,
                   cache_dir="unused", model_vocab_size=256, document_masking=True)  # fmt: skip
    stream = np.concatenate(docs)
    for batch in td.micro_batches(1) + td.micro_batches(2):
        for row in range(2):
            ids = batch["input_ids"][row].numpy()
            start = next(
                s for s in range(0, len(stream), SEQ) if np.array_equal(stream[s : s + SEQ], ids)
            )
            pos, doc = _expected(lengths, start)
            assert np.array_equal(batch["position_ids"][row].numpy(), pos)
            assert np.array_equal(batch["document_ids"][row].numpy(), doc)
    plain = TrainData([StageSpec("s", 1, spec, 5)], sequence_length=SEQ, micro_batch_size=2,
                      batch_accumulation_per_replica=1, dp_rank=0, dp_size=1, tokenizer_path=None,
                      cache_dir="unused", model_vocab_size=256)  # fmt: skip
    assert set(plain.micro_batches(1)[0]) == {"input_ids", "label_ids", "label_mask"}


def test_synthetic_documents_are_packed_progressions_with_their_boundaries():
    data = SyntheticData(3, SEQ, 101, 4, 1, 1, 0, documents=True)
    batch = data.micro_batches(1)[0]
    pos, docs, ids = batch["position_ids"], batch["document_ids"], batch["input_ids"]
    assert pos.shape == docs.shape == ids.shape == (4, SEQ)
    starts = pos == 0
    assert bool(starts[:, 0].all()) and int(starts.sum()) > 4  # several documents per row
    assert torch.equal(docs, starts.cumsum(dim=1))
    # inside a document, each token follows from the one before it (a progression)
    step = (ids[:, 1:] - ids[:, :-1]) % 101
    inside = ~starts[:, 1:]
    for row in range(4):
        for d in docs[row].unique():
            same = inside[row] & (docs[row, 1:] == d)
            assert len(set(step[row][same].tolist())) <= 1
    assert data.micro_batches(1)[0]["input_ids"].shape == (4, SEQ)  # the stream moves on
