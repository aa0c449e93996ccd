"""Tokenizer training, tokenization into Nanosets (text/JSONL/parquet/HF datasets), the CLI
and its errors, Nanoset validation, and the raw-dataset cache used by TrainData."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nanotron_train.data import (
    DataError,
    DatasetSpec,
    Nanoset,
    StageSpec,
    TrainData,
    load_tokenizer,
    tokenize_to_nanoset,
)
from nanotron_train.data.cli import main
from nanotron_train.data.testing import make_tokenizer, tiny_texts


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", vocab_size=300)


def decoded_docs(folder: Path, tok_dir: Path) -> list[str]:
    ns, tok = Nanoset(folder), load_tokenizer(str(tok_dir))
    docs = [ns.document(i) for i in range(ns.metadata.num_documents)]
    assert all(int(d[-1]) == tok.eos_token_id for d in docs)  # EOS after every document
    return [tok.decode(d[:-1]) for d in docs]


def nothing_written(out: Path) -> bool:
    return not out.exists() and not [p for p in out.parent.iterdir() if out.name in p.name]


def test_round_trip_text_files_and_metadata(tmp_path, tok_dir):
    texts = tiny_texts(12, seed=1)
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    out = tokenize_to_nanoset([str(tmp_path / "doc*.txt")], str(tok_dir), tmp_path / "ns",
                              num_workers=1, progress=False)  # fmt: skip
    assert decoded_docs(out, tok_dir) == texts
    meta = json.loads((out / "metadata.json").read_text())
    tok = load_tokenizer(str(tok_dir))
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300
    assert meta["num_documents"] == 12 and meta["eos_token_id"] == tok.eos_token_id
    assert meta["tokenizer"]["sha256"] == tok.sha256
    assert (out / "tokens.bin").stat().st_size == 2 * meta["num_tokens"]
    ends = np.load(out / "doc_ends.npy")
    assert ends.dtype == np.int64 and int(ends[-1]) == meta["num_tokens"]


def test_workers_give_identical_output_and_jsonl_parquet_hf_formats(tmp_path, tok_dir):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = tiny_texts(30, seed=2)
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"content": t, "id": i}) + "\n" for i, t in enumerate(texts))
    )
    pq.write_table(pa.table({"content": texts}), tmp_path / "b.parquet")
    datasets.Dataset.from_dict({"content": texts}).save_to_disk(str(tmp_path / "hf"))
    outs = {}
    for name, inp, workers in (("jsonl", jsonl, 1), ("parquet", tmp_path / "b.parquet", 1),
                               ("hf", tmp_path / "hf", 2)):  # fmt: skip
        argv = ["tokenize", "--input", str(inp), "--tokenizer", str(tok_dir), "--no-progress",
                "--out", str(tmp_path / "out" / name), "--text-column", "content",
                "--num-workers", str(workers)]  # fmt: skip
        assert main(argv) == 0
        assert decoded_docs(tmp_path / "out" / name, tok_dir) == texts
        outs[name] = (tmp_path / "out" / name / "tokens.bin").read_bytes()
    assert outs["jsonl"] == outs["parquet"] == outs["hf"]  # 2 workers == 1 worker


def test_trained_tokenizer_loads_in_transformers(tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    ours = load_tokenizer(str(tok_dir))
    text = tiny_texts(1, seed=5)[0]
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf.decode(ours.encode(text)) == text
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == ours.eos_token_id
    assert load_tokenizer(str(tok_dir / "tokenizer.json")).sha256 == ours.sha256


def test_hub_name_fails_with_offline_hint():
    with pytest.raises(DataError, match="may be offline: pass a local path"):
        load_tokenizer("some-org/surely-not-cached-tokenizer")


def test_train_tokenizer_cli(tmp_path):
    (tmp_path / "in.txt").write_text("\n".join(tiny_texts(20)), encoding="utf-8")
    assert main(["train-tokenizer", "--input", str(tmp_path / "in.txt"), "--vocab-size", "280",
                 "--out", str(tmp_path / "tok")]) == 0  # fmt: skip
    assert load_tokenizer(str(tmp_path / "tok")).vocab_size == 280


def _bad_nanoset(base: Path, tok_dir: Path, kind: str) -> Path:
    (base / "in.txt").write_text("hello world, " * 50, encoding="utf-8")
    folder = tokenize_to_nanoset([str(base / "in.txt")], str(tok_dir), base / kind, progress=False)
    meta = folder / "metadata.json"
    if kind == "missing":
        meta.unlink()
    elif kind == "corrupt":
        meta.write_text("{not json")
    elif kind == "truncated":
        with open(folder / "tokens.bin", "r+b") as f:
            f.truncate(10)
    return folder


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("missing", r"missing/metadata.json: missing Nanoset metadata"),
        ("corrupt", r"corrupt/metadata.json: corrupt Nanoset metadata"),
        ("truncated", r"truncated/tokens.bin: size 10 bytes disagrees"),
        (
            "vocab",
            r"vocab/metadata.json: tokenizer vocab_size 300 exceeds the model's vocab_size 256",
        ),
    ],
)
def test_bad_nanoset_is_one_clear_error(tmp_path, tok_dir, capsys, kind, match):
    folder = _bad_nanoset(tmp_path, tok_dir, kind)
    with pytest.raises(DataError, match=match):
        Nanoset(folder, model_vocab_size=256)
    assert main(["inspect", str(folder), "--model-vocab-size", "256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and str(folder) in err


def _tokenize_argv(inp, tok_dir, out, *extra):
    return ["tokenize", "--input", *inp, "--tokenizer", str(tok_dir), "--out", str(out),
            "--no-progress", "--num-workers", "1", *extra]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("missing", "missing.txt: input does not exist"),
        ("empty", "empty.txt: input holds no text"),
        ("latin1", "latin1.txt: not UTF-8 text"),
        ("latin1_jsonl", "latin1.jsonl: not UTF-8 text"),
        ("nomatch", r"\*.nothing: pattern matches no file"),
        ("jsonl_field", "bad.jsonl:2: no 'text' field"),
        ("vocab", "tokenizer vocab size 300 exceeds the model's vocab_size 100"),
        ("tokenizer", "nope': not a local folder"),
    ],
)
def test_tokenize_cli_errors_exit_2_and_write_nothing(tmp_path, tok_dir, capsys, case, match):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "ok.txt").write_text("fine text " * 10)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"other": "b"}\n')
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    inputs = {
        "missing": [str(tmp_path / "missing.txt")],
        "empty": [str(tmp_path / "empty.txt")],
        "latin1": [str(tmp_path / "ok.txt"), str(tmp_path / "latin1.txt")],
        "nomatch": [str(tmp_path / "*.nothing")],
        "jsonl_field": [str(tmp_path / "bad.jsonl")],
        "latin1_jsonl": [str(tmp_path / "latin1.jsonl")],
    }.get(case, [str(tmp_path / "ok.txt")])
    extra = ["--model-vocab-size", "100"] if case == "vocab" else []
    tok = tmp_path / "nope" if case == "tokenizer" else tok_dir
    out = tmp_path / "out" / "ns"
    assert main(_tokenize_argv(inputs, tok, out, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert __import__("re").search(match, err), err
    assert not out.exists() and (not out.parent.exists() or not list(out.parent.iterdir()))


def test_existing_output_is_refused_then_overwritten(tmp_path, tok_dir, capsys):
    (tmp_path / "a.txt").write_text("first " * 20)
    out = tmp_path / "ns"
    assert main(_tokenize_argv([str(tmp_path / "a.txt")], tok_dir, out)) == 0
    assert main(_tokenize_argv([str(tmp_path / "a.txt")], tok_dir, out)) == 2
    assert "already exists" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("second " * 20)
    assert main(_tokenize_argv([str(tmp_path / "a.txt")], tok_dir, out, "--overwrite")) == 0
    assert decoded_docs(out, tok_dir) == ["second " * 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "ns"]


def test_module_entry_point_exits_2_without_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "nanotron_train.data", "inspect", str(tmp_path / "none")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path / 'none'}: Nanoset folder does not exist"


def test_train_data_tokenizes_raw_dataset_once_into_cache(tmp_path, tok_dir):
    texts = tiny_texts(40, seed=3, words=120)
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    spec = DatasetSpec(hf_dataset_or_datasets=str(raw), text_column_name="body")
    calls = []

    def build(rank):
        return TrainData([StageSpec("s", 1, spec, 0)], sequence_length=16, micro_batch_size=2,
                         batch_accumulation_per_replica=1, dp_rank=rank, dp_size=2,
                         tokenizer_path=str(tok_dir), cache_dir=str(tmp_path / "cache"),
                         model_vocab_size=300, barrier=lambda error: calls.append(rank),
                         is_builder=rank == 0)  # fmt: skip

    first = build(0)
    (folder,) = (tmp_path / "cache").iterdir()
    assert decoded_docs(folder, tok_dir) == texts
    mtime = (folder / "tokens.bin").stat().st_mtime_ns
    second = build(1)  # not the builder: waits on the barrier, then reads the same folder
    assert calls == [0, 1] and len(list((tmp_path / "cache").iterdir())) == 1
    assert (folder / "tokens.bin").stat().st_mtime_ns == mtime
    batch0, batch1 = first.micro_batches(1)[0], second.micro_batches(1)[0]
    assert batch0["input_ids"].shape == batch1["input_ids"].shape == (2, 16)
    assert not np.array_equal(batch0["input_ids"].numpy(), batch1["input_ids"].numpy())


def test_default_corpus_files_and_cached_preparation(tmp_path, capsys):
    from nanotron_train.data.corpus import stdlib_files

    real = stdlib_files()
    assert len(real) > 300 and all(p.suffix == ".py" for p in real)
    skipped = {"test", "tests", "idle_test", "site-packages"}
    assert not any(skipped.intersection(p.parts) for p in real)
    src = tmp_path / "lib"
    for rel, text in (("a.py", "def f(x):\n    return x + 1\n" * 30), ("pkg/b.py", "import os\n" * 40),
                      ("test/t.py", "SKIPPED = 1\n"), ("site-packages/s.py", "SKIPPED = 2\n")):  # fmt: skip
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    (src / "latin.py").write_bytes("x = 'café'\n".encode("latin-1"))
    argv = ["prepare-default", "--cache-dir", str(tmp_path / "cache"), "--vocab-size", "300",
            "--source-root", str(src), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    tok_dir = Path(out.split("tokenizer: ")[1].split("\n")[0])
    ns_dir = Path(out.split("nanoset: ")[1].split("\n")[0])
    assert decoded_docs(ns_dir, tok_dir) == [
        (src / "a.py").read_text(),
        (src / "pkg/b.py").read_text(),
    ]
    stamp = (
        (tok_dir / "tokenizer.json").stat().st_mtime_ns,
        (ns_dir / "tokens.bin").stat().st_mtime_ns,
    )
    assert main(argv) == 0  # cached: a no-op
    assert stamp == ((tok_dir / "tokenizer.json").stat().st_mtime_ns,
                     (ns_dir / "tokens.bin").stat().st_mtime_ns)  # fmt: skip
    assert len(list((tmp_path / "cache").iterdir())) == 1
