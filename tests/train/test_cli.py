"""The entry point: bad configs give one line naming key and file (exit 2), and a real
2-process torchrun writes the metrics file."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nanotron_train.__main__ import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-llama-cpu.yaml"


def small_config(tmp_path: Path, **changes) -> dict:
    data = yaml.safe_load(TINY.read_text())
    data["model"]["model_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    data["tokens"].update(sequence_length=16, micro_batch_size=2, batch_accumulation_per_replica=1)
    data["tokens"]["train_steps"] = 3
    data["logging"]["metrics_file"] = str(tmp_path / "metrics.jsonl")
    data["checkpoints"]["checkpoints_path"] = str(tmp_path / "ckpt")
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return data


def write(tmp_path: Path, data: dict, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def run_main(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_unknown_key(tmp_path, capsys):
    data = small_config(tmp_path)
    data["optimizer"]["learning_rate_schedulr"] = {}
    path = write(tmp_path, data)
    code, err = run_main(capsys, ["--config-file", str(path)])
    assert code == 2
    assert str(path) in err and "optimizer.learning_rate_schedulr" in err and "unknown key" in err
    assert err.count("\n") == 1


def test_wrong_type(tmp_path, capsys):
    path = write(tmp_path, small_config(tmp_path, tokens__micro_batch_size="two"))
    code, err = run_main(capsys, ["--config-file", str(path)])
    assert code == 2
    assert str(path) in err and "tokens.micro_batch_size" in err and "integer" in err


def test_missing_value(tmp_path, capsys):
    data = small_config(tmp_path)
    del data["optimizer"]["learning_rate_scheduler"]["learning_rate"]
    path = write(tmp_path, data)
    code, err = run_main(capsys, ["--config-file", str(path)])
    assert code == 2
    assert "optimizer.learning_rate_scheduler.learning_rate" in err and "missing" in err


def test_world_size_mismatch(tmp_path, capsys):
    path = write(tmp_path, small_config(tmp_path, parallelism__dp=2, parallelism__tp=2))
    code, err = run_main(capsys, ["--config-file", str(path)])
    assert code == 2
    assert (
        str(path) in err
        and "parallelism" in err
        and "2*2*1 = 4" in err
        and "world size is 1" in err
    )


def test_heads_vs_tp(tmp_path, capsys, monkeypatch):
    # Validation runs before any process group: a fake world of 3 is enough to reach it.
    monkeypatch.setenv("WORLD_SIZE", "3")
    path = write(tmp_path, small_config(tmp_path, parallelism__tp=3))
    code, err = run_main(capsys, ["--config-file", str(path)])
    assert code == 2
    assert str(path) in err and "model.model_config.num_attention_heads" in err and "tp (3)" in err


def test_override_unknown_key_and_value(tmp_path, capsys):
    path = write(tmp_path, small_config(tmp_path))
    code, err = run_main(capsys, ["--config-file", str(path), "--override", "tokens.train_stepz=3"])
    assert code == 2 and "tokens.train_stepz" in err and "--override" in err
    code, err = run_main(
        capsys, ["--config-file", str(path), "--override", "optimizer.zero_stage=4"]
    )
    assert code == 2 and "optimizer.zero_stage" in err


def test_missing_file(tmp_path, capsys):
    code, err = run_main(capsys, ["--config-file", str(tmp_path / "nope.yaml")])
    assert code == 2 and "nope.yaml" in err


def test_subprocess_prints_no_traceback(tmp_path):
    path = write(tmp_path, small_config(tmp_path, tokens__sequence_length="long"))
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "nanotron_train", "--config-file", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}: tokens.sequence_length: expected an integer, got str 'long'"
    ]


@pytest.mark.slow
def test_torchrun_two_processes_writes_metrics(tmp_path):
    data = small_config(tmp_path, parallelism__dp=2)
    data["optimizer"]["zero_stage"] = 1
    path = write(tmp_path, data)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "nanotron_train",
         "--config-file", str(path), "--override", "tokens.train_steps=4"],
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    gbs_tokens = 2 * 1 * 2 * 16
    assert [r["consumed_tokens"] for r in records] == [gbs_tokens * k for k in (1, 2, 3, 4)]
    for r in records:
        assert math.isfinite(r["lm_loss"]) and r["lm_loss"] > 0
        assert r["grad_norm"] > 0 and r["tokens_per_sec"] > 0
        assert r["tokens_per_sec_per_gpu"] == pytest.approx(r["tokens_per_sec"] / 2)
        assert r["mfu"] is None  # no known peak on the CPU
    assert "iteration: 4 / 4" in proc.stdout
