"""Nanotron's data keys: a folder in datatrove's layout (tests/train/datatrove_writer.py)
is read in place and yields the same samples as our Nanoset of the same tokens, with
Nanotron's dataset keys; Hugging Face datasets with their splits, cache and Nanotron's mixer.
A Nanotron checkpoint imported: test_nanotron_checkpoint_import.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from nanotron_train.data import DataError, DatasetSpec, StageSpec, TrainData
from nanotron_train.data.nanoset import NanosetWriter
from tests.train.datatrove_writer import documents, write_datatrove

SEQ, MBS, ACCUM = 8, 2, 2


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


def test_tokenizer_name_is_compared_by_what_it_loads(tmp_path):
    """A tokenizer named by its folder, its tokenizer.json or a name recorded by datatrove is
    the same tokenizer: the file contents decide (our metadata records their sha256)."""
    from nanotron_train.data.datatrove import check_tokenizer_name
    from nanotron_train.data.testing import make_tokenizer, tiny_texts
    from nanotron_train.data.tokenizer import file_sha256

    tok = make_tokenizer(tmp_path / "tok", tiny_texts(20))
    other = make_tokenizer(tmp_path / "other", tiny_texts(20, seed=1), vocab_size=280)
    file, sha = tok / "tokenizer.json", file_sha256(tok / "tokenizer.json")
    for name in (str(tok), str(file), str(tmp_path / "." / "tok")):
        assert check_tokenizer_name("ns", name, str(file), {"sha256": sha}) is None  # ours
        assert check_tokenizer_name("dt", name, str(tok), {}) is None  # datatrove's: a name
    with pytest.raises(DataError) as err:
        check_tokenizer_name("ns", str(other), str(file), {"sha256": sha})
    theirs = file_sha256(other / "tokenizer.json")
    assert str(err.value) == (
        f"ns: tokenizer_name is '{other}' but the folder was tokenized with '{file}', and they "
        f"are different tokenizers (sha256 {theirs[:12]} and {sha[:12]})"
    )
    with pytest.raises(DataError) as err:
        check_tokenizer_name("dt", str(tok), "org/absent", {})
    assert str(err.value) == (
        f"dt: tokenizer_name is '{tok}' but the folder was tokenized with 'org/absent', and "
        "'org/absent' is not readable here to compare them by content"
    )


def test_hf_dataset_keys_splits_and_overwrite_cache(tmp_path):
    import datasets

    from nanotron_train.data import load_tokenizer
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    train, val = tiny_texts(30, seed=1), tiny_texts(30, seed=2)
    folder = tmp_path / "hf"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": train}),
         "validation": datasets.Dataset.from_dict({"text": val})}
    ).save_to_disk(str(folder))  # fmt: skip
    tok_dir = make_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tok_dir))

    def stream(**keys) -> list[int]:
        spec = DatasetSpec(hf_dataset_or_datasets=str(folder), **keys)
        td = TrainData([StageSpec("s", 1, spec, 0)], sequence_length=SEQ, micro_batch_size=1,
                       batch_accumulation_per_replica=1, dp_rank=0, dp_size=1,
                       tokenizer_path=str(tok_dir), cache_dir=str(tmp_path / "cache"),
                       model_vocab_size=tok.vocab_size)  # fmt: skip
        return td._stages[0].nanosets[0].tokens.tolist()

    def expected(texts: list[str]) -> list[int]:
        return [t for text in texts for t in [*tok.encode(text), tok.eos_token_id]]

    assert stream() == expected(train)  # Nanotron's default split: train
    assert stream(hf_dataset_splits="validation") == expected(val)
    assert stream(
        hf_dataset_splits=["validation", "train"], dataset_processing_num_proc_per_process=2
    ) == expected(val + train)
    cached = sorted((tmp_path / "cache").iterdir())
    stamp = [(p / "metadata.json").stat().st_mtime_ns for p in cached]
    stream(dataset_overwrite_cache=True)
    assert [(p / "metadata.json").stat().st_mtime_ns for p in cached] != stamp  # rebuilt
    stream()
    with pytest.raises(DataError, match="no split 'test'"):
        stream(hf_dataset_splits="test")


def test_hf_dataset_mixer_selects_nanotron_rows(tmp_path):
    """Nanotron's mixer {dataset: fraction} (processing.py _get_dataset_mix): each dataset's
    train split cut to its first int(fraction * rows), concatenated in the mapping's order,
    shuffled with seed 42; the tokens are those rows' in that order. A list, an empty
    mapping, a fraction outside [0, 1] and two train splits are refused naming the key."""
    import datasets

    from nanotron_train.data import load_tokenizer
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    a, b = tiny_texts(10, seed=3), tiny_texts(9, seed=4)
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": a}),
         "test": datasets.Dataset.from_dict({"text": tiny_texts(5, seed=5)})}
    ).save_to_disk(str(tmp_path / "a"))  # fmt: skip
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in b))
    tok_dir = make_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tok_dir))

    def stream(value, **keys) -> list[int]:
        spec = DatasetSpec(hf_dataset_or_datasets=value, **keys)
        td = TrainData([StageSpec("s", 1, spec, 0)], sequence_length=SEQ, micro_batch_size=1,
                       batch_accumulation_per_replica=1, dp_rank=0, dp_size=1,
                       tokenizer_path=str(tok_dir), cache_dir=str(tmp_path / "cache"),
                       model_vocab_size=tok.vocab_size)  # fmt: skip
        return td._stages[0].nanosets[0].tokens.tolist()

    # Nanotron's rule written out: a[:10] + b[:int(0.5 * 9) = 4], permuted as
    # datasets' shuffle(seed=42) permutes (numpy default_rng(42)).
    rows = a + b[:4]
    order = np.random.default_rng(42).permutation(len(rows))
    want = [t for i in order for t in [*tok.encode(rows[i]), tok.eos_token_id]]
    mix = {str(tmp_path / "a"): 1.0, str(tmp_path / "b.jsonl"): 0.5}
    assert stream(mix) == want
    assert stream(mix, hf_dataset_splits=["train", "test"]) == want  # test: unused, as there
    cache = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(cache) == 2 and cache[1].startswith("mix-")  # mixed and tokenized once
    # dataset_overwrite_cache: mixed and tokenized again under the same keys (the tokens were
    # keyed by the rebuilt mix's file times: each run left another token folder behind)
    stamps = [(tmp_path / "cache" / n).stat().st_mtime_ns for n in cache]
    assert stream(mix, dataset_overwrite_cache=True) == want
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == cache
    assert [(tmp_path / "cache" / n).stat().st_mtime_ns for n in cache] != stamps
    assert sorted(p.name for p in (tmp_path / "a" / "train").iterdir()) == [
        "data-00000-of-00001.arrow", "dataset_info.json", "state.json",
    ]  # nothing written into the user's dataset  # fmt: skip
    for value, splits, message in [
        ([str(tmp_path / "a")], None, "a list of datasets is refused"),
        ({}, None, "the dataset mapping is empty"),
        ({str(tmp_path / "a"): 1.5}, None, "fraction 1.5 outside [0, 1]"),
        ({str(tmp_path / "a"): -0.1}, None, "fraction -0.1 outside [0, 1]"),
        ({str(tmp_path / "a"): 1.0}, ["train", "train2"], "exactly one train split"),
        ({str(tmp_path / "a"): 1.0}, ["validation"], "'validation' is neither"),
    ]:
        key = re.escape("data_stages[0].data.dataset.hf_dataset_or_datasets: ")
        with pytest.raises(DataError, match=key + ".*" + re.escape(message)):
            stream(value, hf_dataset_splits=splits)


def test_nanotron_mamba_example_loads_with_its_dataset_mapping(tmp_path):
    """config_mamba.yaml keeps its {dataset: 1.0} form with only the dataset path changed
    (a local folder): it loads, the mapping absolute; a bad fraction is one line naming the
    key and the file."""
    import yaml

    from nanotron_train.config import ConfigError, load_config
    from nanotron_train.config.training_inputs import prepare_for_training

    config = yaml.safe_load((Path(__file__).parent / "nanotron" / "config_mamba.yaml").read_text())
    dataset = config["data_stages"][0]["data"]["dataset"]
    assert dataset["hf_dataset_or_datasets"] == {"roneneldan/TinyStories": 1.0}
    (tmp_path / "stories").mkdir()
    (tmp_path / "stories" / "a.txt").write_text("Once upon a time.")
    path = tmp_path / "config.yaml"
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the mapping's inputs are relative to the run's folder
    try:
        dataset["hf_dataset_or_datasets"] = {"stories": 1.0}
        path.write_text(yaml.safe_dump(config))
        cfg = prepare_for_training(load_config(path), str(path))  # as each run does
        errors = []
        for value in ({"stories": 1.5}, ["stories"]):
            dataset["hf_dataset_or_datasets"] = value
            path.write_text(yaml.safe_dump(config))
            with pytest.raises(ConfigError) as err:
                load_config(path)
            errors.append(str(err.value))
    finally:
        os.chdir(cwd)
    got = cfg.data_stages[0].data.dataset.hf_dataset_or_datasets
    assert got == {str(tmp_path / "stories"): 1.0}
    key = "data_stages.0.data.dataset.hf_dataset_or_datasets"
    for error, message in zip(errors, ["fraction 1.5 outside [0, 1]", "a list of datasets"]):
        assert error.count("\n") == 0 and str(path) in error and key in error
        assert message in error
