"""Validation: held-out documents, the fixed validation batches, evaluation during training
(unchanged training, exact resume), the evaluate CLI, and bad inputs.

Layout equality of val_loss is in the equivalence matrix (test_equivalence.py and
test_equivalence_perf.py).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from nanotron_train.config import ConfigError, config_from_dict
from nanotron_train.data import DataError, Nanoset
from nanotron_train.data.nanoset import NanosetWriter
from nanotron_train.data.split import split_by_documents
from nanotron_train.data.stages import DatasetSpec, StageSpec
from nanotron_train.data.testing import make_id_nanoset
from nanotron_train.data.train_data import TrainData
from nanotron_train.data.validation import ValidationData

S = 16


def doc_id_nanoset(path, num_docs: int, length: int = 13, sha: str = "", offset: int = 0) -> str:
    """Document k is `length - 1` copies of the id offset + k + 1, then EOS (0): every token
    names its document."""
    writer = NanosetWriter(path, vocab_size=128, eos_token_id=0, tokenizer_path="ids",
                           tokenizer_sha256=sha)  # fmt: skip
    docs = [np.append(np.full(length - 1, offset + k + 1), 0) for k in range(num_docs)]
    writer.add_documents(np.concatenate(docs), np.full(num_docs, length))
    return str(writer.finish())


def train_data(folders: list[str], split: float, dp_rank: int = 0, dp_size: int = 1):
    stage = StageSpec("s", 1, DatasetSpec(dataset_folder=folders), seed=5)
    return TrainData([stage], sequence_length=S, micro_batch_size=2,
                     batch_accumulation_per_replica=2, dp_rank=dp_rank, dp_size=dp_size,
                     tokenizer_path=None, cache_dir="unused", model_vocab_size=128,
                     validation_split=split)  # fmt: skip


def test_split_never_trains_on_validation_documents(tmp_path):
    """Over 4 epochs, for dp 1 and 2 and a blend of two folders, no token of a held-out
    document is an input or a label of training; the validation batches hold only held-out
    documents, every validation sample once."""
    a = doc_id_nanoset(tmp_path / "a", 60)  # ids 1..60
    b = doc_id_nanoset(tmp_path / "b", 30, offset=70)  # ids 71..100
    held_out = set(range(55, 61)) | set(range(98, 101))  # the last ceil(0.1 * docs) of each
    seen: set[int] = set()
    for dp_size in (1, 2):
        for rank in range(dp_size):
            data = train_data([a, b], 0.1, rank, dp_size)
            samples = sum(ns.num_samples(S) for ns in data._stages[0].nanosets)
            steps = 4 * samples // data.global_batch_size + 1  # > 4 epochs of each folder
            for step in range(1, steps + 1):
                for mb in data.micro_batches(step):
                    seen |= set(mb["input_ids"].flatten().tolist())
                    seen |= set(mb["label_ids"].flatten().tolist())
    assert not seen & held_out
    kept = set(range(0, 55)) | set(range(71, 98))
    # trained on the kept documents up to the last whole sample before the held-out ones
    assert seen <= kept and len(kept - seen) <= 2, sorted(kept - seen)
    data = train_data([a, b], 0.1)
    assert [ns.part for ns in data.held_out.values()] == ["validation", "validation"]
    val = ValidationData(list(data.held_out.values()), None, sequence_length=S,
                         micro_batch_size=2, batch_accumulation_per_replica=2, dp_rank=0,
                         dp_size=1)  # fmt: skip
    rows = []
    for micro_batches, weights in val.batches():
        for mb, w in zip(micro_batches, weights):
            assert w == float(mb["label_mask"].sum())
            for tokens, mask in zip(mb["input_ids"], mb["label_mask"]):
                if mask.any():
                    rows.append(tokens.tolist())
                    assert set(tokens.tolist()) - {0} <= held_out
    # 6 docs * 13 tokens = 78 tokens -> 4 samples; 3 docs * 13 = 39 -> 2 samples
    assert val.num_samples == 6 and len(rows) == 6 and val.num_batches == 2


def test_validation_batches_do_not_depend_on_dp(tmp_path):
    """The union over dp ranks of the labelled validation rows is the same set for dp 1, 2, 4
    (global batch fixed at 8), limit_val_batches takes a prefix, padding weighs nothing."""
    folder = Nanoset(make_id_nanoset(tmp_path / "v", [30] * 24, high=128, vocab_size=128))

    def rows(dp: int, limit: int) -> list:
        out = []
        for rank in range(dp):
            data = ValidationData([folder], None, sequence_length=S, micro_batch_size=2,
                                  batch_accumulation_per_replica=4 // dp, dp_rank=rank,
                                  dp_size=dp, limit_batches=limit)  # fmt: skip
            for b, (mbs, _) in enumerate(data.batches()):
                for mb in mbs:
                    keep = mb["label_mask"].all(dim=1)
                    assert (keep | ~mb["label_mask"].any(dim=1)).all()  # whole rows or padding
                    out += [(b, tuple(r)) for r in mb["input_ids"][keep].tolist()]
        return sorted(out)

    whole = rows(1, 0)
    assert len(whole) == (24 * 30 - 1) // S == 44 and len({r for _, r in whole}) == 44
    assert rows(2, 0) == rows(4, 0) == whole
    assert rows(2, 2) == [r for r in whole if r[0] < 2] and len(rows(2, 2)) == 16


@pytest.mark.parametrize(
    "patch, key",
    [
        ({"tokens": {"val_check_interval": 5}}, "tokens.val_check_interval: needs a validation"),
        ({"tokens": {"limit_val_batches": 2}}, "tokens.limit_val_batches: needs a validation"),
        ({"tokens": {"limit_test_batches": 2}}, "tokens.limit_test_batches"),
        ({"validation": {"split": 0.0}}, "validation.split: must be a fraction"),
        ({"validation": {"split": 1.0}}, "validation.split: must be a fraction"),
        ({"validation": {"split": 0.1}}, "validation.split: needs real training data"),
        ({"validation": {}}, "validation: give exactly one"),
        ({"validation": {"dataset": {"dataset_folder": []}}}, "validation.dataset.dataset_folder"),
        (
            {"validation": {"split": 0.1}, "tokens": {"val_check_interval": 0}},
            "tokens.val_check_interval: must be >= 1",
        ),
        ({"validation": {"dataset": {"folder": "x"}}}, "validation.dataset.folder"),
    ],
)
def test_config_errors(patch, key):
    from tests.train.test_equivalence import base_config

    raw = base_config()
    for section, values in patch.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "cfg.yaml")
    assert key in str(err.value) and "\n" not in str(err.value)


def test_split_data_errors(tmp_path):
    folder = Nanoset(doc_id_nanoset(tmp_path / "a", 40))
    with pytest.raises(DataError, match="an empty split"):
        split_by_documents(folder, 0.01, S)  # one document of 13 tokens < one sample of 17
    with pytest.raises(DataError, match="leaves no document for training"):
        split_by_documents(folder, 0.99, S)
    with pytest.raises(DataError, match=r"must be a fraction of documents in \(0, 1\)"):
        split_by_documents(folder, 1.0, S)


# ---- in training: unchanged, exact resume, and the evaluate CLI ------------------------------


def run_config(folder: str, ckpt: str, interval: int, steps: int = 6, resume=None) -> dict:
    from tests.train.test_checkpoint import tiny_config

    raw = tiny_config({"dp": 1, "tp": 1, "pp": 1}, ckpt, steps=steps, resume=resume)
    raw["model"]["model_config"]["vocab_size"] = 128
    raw["checkpoints"]["checkpoint_interval"] = 3
    raw["data_stages"][0]["data"]["dataset"] = {"dataset_folder": folder}
    raw["tokens"]["val_check_interval"] = interval
    raw["validation"] = {"split": 0.1}
    return raw


def train_records(raw: dict, stream=None) -> list[dict]:
    from nanotron_train.trainer import train

    torch.set_num_threads(1)
    records: list[dict] = []
    cfg = config_from_dict(raw, "test")
    train(cfg, stream=stream or io.StringIO(), on_record=records.append, every_step=True)
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("val")
    folder = make_id_nanoset(root / "data", [40] * 80, high=128, vocab_size=128, seed=3)
    raw = run_config(str(folder), str(root / "ck"), interval=2)
    raw["logging"].update(metrics_file=str(root / "metrics.jsonl"), iteration_step_info_interval=4)
    stdout = io.StringIO()
    full = train_records(raw, stdout)
    at_end = train_records(run_config(str(folder), str(root / "ck_end"), interval=-1))
    resumed = train_records(
        run_config(str(folder), str(root / "ck_r"), interval=2, resume=str(root / "ck" / "3"))
    )
    return {"root": root, "folder": str(folder), "full": full, "at_end": at_end,
            "resumed": resumed, "stdout": stdout.getvalue()}  # fmt: skip


def test_training_unchanged_and_resume_exact(runs):
    full, at_end, resumed = runs["full"], runs["at_end"], runs["resumed"]
    assert [r["lm_loss"] for r in full] == [r["lm_loss"] for r in at_end]
    assert [r["grad_norm"] for r in full] == [r["grad_norm"] for r in at_end]
    assert [r["step"] for r in full if "val_loss" in r] == [2, 4, 6]
    assert [r["step"] for r in at_end if "val_loss" in r] == [6]
    assert full[-1]["val_loss"] == at_end[-1]["val_loss"]
    assert full[-1]["val_ppl"] == pytest.approx(np.exp(full[-1]["val_loss"]), rel=1e-12)
    vals = [r["val_loss"] for r in full if "val_loss" in r]
    assert vals[0] > vals[-1] and 3.0 < vals[-1] < 6.0, vals
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for key in ("lm_loss", "grad_norm", "val_loss"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in full[3:]], key


def test_validation_is_logged(runs):
    """Evaluating steps are logged even off the info interval (4): stdout and metrics file."""
    lines = [line for line in runs["stdout"].splitlines() if line.startswith("iteration:")]
    assert [line.split(" / ")[0] for line in lines] == ["iteration: 2", "iteration: 4",
                                                        "iteration: 6"]  # fmt: skip
    val = {r["step"]: r for r in runs["full"] if "val_loss" in r}
    for line in lines:
        step = int(line.split(" / ")[0].split()[1])
        assert (
            f"val_loss: {val[step]['val_loss']:.4g} | val_ppl: {val[step]['val_ppl']:.4g}" in line
        )
    with open(runs["root"] / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert [(r["step"], r["val_loss"], r["val_ppl"]) for r in logged] == [
        (s, val[s]["val_loss"], val[s]["val_ppl"]) for s in (2, 4, 6)
    ]


def test_evaluate_cli_matches_training(runs, capsys):
    from nanotron_train.evaluate import main

    args = ["--ckpt-path", str(runs["root"] / "ck" / "6"), "--dataset-folder", runs["folder"],
            "--split", "0.1", "--json"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 6 and report["samples"] == (8 * 40 - 1) // S
    assert report["val_loss"] == pytest.approx(runs["full"][-1]["val_loss"], rel=1e-6, abs=0)
    assert report["tokens"] == report["samples"] * S
    assert main(args[:-1] + ["--limit-batches", "1"]) == 0
    line = capsys.readouterr().out
    assert "val_loss: " in line and "tokens: 64 " in line and "batches: 1 " in line  # 4 x 16


def cli_on_rank(args: list[str]) -> tuple[int, str]:
    """One rank of `torchrun -m nanotron_train.evaluate ARGS`: its exit code and stdout."""
    import contextlib

    from nanotron_train.evaluate import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    return code, out.getvalue()


def cli_tp2_then_pp2(args: list[str]) -> list[tuple[int, str]]:
    """One rank of the evaluate command at tp=2, then at pp=2 (--pp 2). The world group is
    made once here: two commands each making and destroying it would race on the store."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        return [cli_on_rank(args), cli_on_rank([*args, "--pp", "2"])]
    finally:
        dist.destroy_process_group()


def test_evaluate_cli_tp2_and_pp2_match_training(runs):
    from nanotron_parallel.testing import run_distributed

    args = ["--ckpt-path", str(runs["root"] / "ck"), "--dataset-folder", runs["folder"],
            "--split", "0.1", "--json"]  # fmt: skip
    rank0, rank1 = run_distributed(cli_tp2_then_pp2, 2, args, timeout=180)
    for (code0, out0), (code1, out1), layout in zip(rank0, rank1, [(2, 1), (1, 2)]):
        assert (code0, code1, out1) == (0, 0, "")  # rank 0 alone prints
        report = json.loads(out0)
        assert (report["tp"], report["pp"]) == layout and report["step"] == 6
        assert report["val_loss"] == pytest.approx(runs["full"][-1]["val_loss"], rel=1e-5, abs=0)


def test_evaluate_cli_refuses_another_tokenizer(runs, tmp_path, capsys):
    from nanotron_train.evaluate import main

    other = doc_id_nanoset(tmp_path / "other", 20, sha="f" * 64)
    code = main(["--ckpt-path", str(runs["root"] / "ck"), "--dataset-folder", other])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "another tokenizer" in err and other in err
    wide = make_id_nanoset(tmp_path / "wide", [40] * 4, high=300, vocab_size=300)
    assert main(["--ckpt-path", str(runs["root"] / "ck"), "--dataset-folder", str(wide)]) == 2
    assert "exceeds the model's vocab_size 128" in capsys.readouterr().err


def test_validation_folder_with_another_tokenizer_is_refused(runs, tmp_path):
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.data.source import build_data, build_validation_data

    other = doc_id_nanoset(tmp_path / "other", 20, sha="f" * 64)
    raw = run_config(runs["folder"], str(tmp_path / "ck"), interval=2)
    raw["validation"] = {"dataset": {"dataset_folder": [other]}}
    cfg = config_from_dict(raw, "test")
    pc = ParallelContext(dp=1, tp=1, pp=1)
    try:
        with pytest.raises(DataError, match="tokenized with another tokenizer"):
            build_validation_data(cfg, pc, build_data(cfg, pc))
    finally:
        pc.destroy()
