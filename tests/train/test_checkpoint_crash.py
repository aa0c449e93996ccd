"""A real `python -m nanotron_train` killed with SIGKILL in the middle of a save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.train.test_checkpoint import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _start(cfg: Path, extra_env: dict, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "nanotron_train", "--config-file", str(cfg), *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    raw = tiny_config({"dp": 1, "tp": 1, "pp": 1}, str(ck), steps=4)
    raw["checkpoints"]["checkpoint_interval"] = 2
    raw["logging"]["metrics_file"] = str(tmp_path / "metrics.jsonl")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    proc = _start(cfg, {"NANOTRON_TEST_CKPT_SLOW_WRITE_S": "0.5"})
    tmp4 = ck / ".tmp-4" / "model" / "pp0_tp0.safetensors"
    deadline = time.monotonic() + 120
    try:
        while not tmp4.exists():  # the second save has written its first shard
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the save window never came"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert (ck / "latest.txt").read_text().strip() == "2"
    assert not (ck / "4").exists() and (ck / ".tmp-4").is_dir()
    assert (ck / "2" / "checkpoint_metadata.json").is_file()

    resumed = _start(cfg, {}, "--resume", "latest")
    out, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, out
    assert "removing unfinished checkpoint save" in out and "resumed from" in out, out
    assert (ck / "latest.txt").read_text().strip() == "4"
    assert not (ck / ".tmp-4").exists()
    meta = json.loads((ck / "4" / "checkpoint_metadata.json").read_text())
    assert meta["step"] == 4 and meta["consumed_samples"] == 16
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-2:] == [3, 4]
