"""Nanotron's tokenized data read in place: a folder in datatrove's layout (written here from
its documented format) yields the same samples as our Nanoset of the same tokens, with
Nanotron's dataset keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nanotron_train.data import DataError, DatasetSpec, StageSpec, TrainData
from nanotron_train.data.nanoset import NanosetWriter

SEQ, MBS, ACCUM = 8, 2, 2


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


def write_ours(folder: Path, docs: list[np.ndarray], tokenizer="org/tok") -> Path:
    writer = NanosetWriter(folder, vocab_size=256, eos_token_id=0, tokenizer_path=tokenizer,
                           tokenizer_sha256="")  # fmt: skip
    writer.add_documents(np.concatenate(docs), np.asarray([len(d) for d in docs]))
    return writer.finish()


def data(folders: list[Path], steps: int = 4, dp: int = 1, **spec) -> list[dict]:
    spec.setdefault("dataset_weights", [0.6, 0.4][: len(folders)] if len(folders) > 1 else None)
    stage = StageSpec("s", 1, DatasetSpec(dataset_folder=[str(f) for f in folders], **spec), 5)
    out = []
    for rank in range(dp):
        td = TrainData([stage], sequence_length=SEQ, micro_batch_size=MBS,
                       batch_accumulation_per_replica=ACCUM // dp, dp_rank=rank, dp_size=dp,
                       tokenizer_path=None, cache_dir="unused", model_vocab_size=256)  # fmt: skip
        out.append([td.micro_batches(k) for k in range(1, steps + 1)])
    return [mb for step in zip(*out) for rank_mbs in step for mb in rank_mbs]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def test_datatrove_folder_yields_our_nanosets_samples(tmp_path):
    a1, a2, b = documents(1, 40), documents(2, 25), documents(3, 50)
    dt_a = write_datatrove(tmp_path / "dt_a", [a1, a2])  # two task files: one stream
    dt_b = write_datatrove(tmp_path / "dt_b", [b], size=4)
    ours_a, ours_b = write_ours(tmp_path / "ns_a", a1 + a2), write_ours(tmp_path / "ns_b", b)
    theirs = data([dt_a, dt_b])
    assert same(theirs, data([ours_a, ours_b]))  # blended, shuffled: the same samples
    assert same(theirs, data([dt_a, dt_b], dp=2))  # and independent of dp
    first = theirs[0]["input_ids"][0].tolist()
    stream = np.concatenate(a1 + a2).tolist()
    assert any(stream[i : i + SEQ] == first for i in range(0, len(stream), SEQ))


def test_nanoset_keys_on_both_formats(tmp_path):
    a1, a2 = documents(4, 30), documents(5, 30)
    dt = write_datatrove(tmp_path / "dt", [a1, a2])
    # return_positions: position ids restart at each document, from .index / doc_ends.npy
    with_pos = data([dt], return_positions=True)
    assert same(with_pos, data([write_ours(tmp_path / "ns", a1 + a2)], return_positions=True))
    for mb in with_pos:
        for ids, pos in zip(mb["input_ids"].tolist(), mb["position_ids"].tolist()):
            for i in range(1, SEQ):  # restart exactly after the EOS (0) that ends a document
                assert pos[i] == (0 if ids[i - 1] == 0 else pos[i - 1] + 1)
    assert any(0 in mb["position_ids"][:, 1:] for mb in with_pos)  # restarts do happen
    # shuffle_files: the files' order comes from the stage seed
    order = np.random.RandomState(5).permutation(2)
    parts = [a1, a2]
    shuffled_ns = write_ours(tmp_path / "ns_shuf", parts[order[0]] + parts[order[1]])
    assert same(data([dt], shuffle_files=True), data([shuffled_ns]))
    # dataset_max_tokens: only the first N tokens
    n = sum(len(d) for d in a1) + 7
    cut = write_ours(tmp_path / "ns_cut", a1 + [np.concatenate(a2)[:7]])
    assert same(data([dt], dataset_max_tokens=[n]), data([cut]))
    # dataset_read_path: read the copy where it exists
    copy = write_datatrove(tmp_path / "copy", [a2, a1])
    assert same(data([dt], dataset_read_path=[str(copy)]), data([copy]))
    assert same(data([dt], dataset_read_path=[str(tmp_path / "absent")]), data([dt]))
    # tokenizer_name and token_size_in_bytes are checked against what the folder records
    with pytest.raises(DataError, match="tokenized with 'org/tok'"):
        data([dt], tokenizer_name="other/tok")
    with pytest.raises(
        DataError, match="token_size_in_bytes is 4 but the folder's metadata says 2"
    ):
        data([dt], token_size_in_bytes=4)
    bare = write_datatrove(tmp_path / "bare", [a1], tokenizer=None)
    with pytest.raises(DataError, match="set dataset.token_size_in_bytes"):
        data([bare])
    assert same(data([bare], token_size_in_bytes=2), data([write_ours(tmp_path / "ns1", a1)]))
