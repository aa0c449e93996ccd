"""End to end: a real 2-process torchrun training streams to a real dashboard.

The run appears finished with every step's values equal to the metrics file, its checkpoints
are listed with a resume command, that command continues the run (linked to its parent, with
only its own points), and a dashboard URL where nothing listens changes nothing but one warning.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.dashboard.dashboard_helpers import Dashboard, free_port, start_dashboard

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
STEPS = 6


def tiny_config() -> dict:
    """Two pipeline stages, synthetic tokens, a checkpoint every 3 steps (relative paths)."""
    data = yaml.safe_load((REPO / "configs" / "tiny-llama-cpu.yaml").read_text())
    data["general"].update(project="e2e", run="tiny")
    data["parallelism"].update(dp=1, tp=1, pp=2)
    data["model"]["model_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    data["tokens"].update(
        sequence_length=16, micro_batch_size=2, batch_accumulation_per_replica=2, train_steps=STEPS
    )
    data["checkpoints"].update(checkpoints_path="ck", checkpoint_interval=3)
    data["logging"].update(metrics_file="metrics.jsonl", dashboard_url=None)
    return data


def train(cwd: Path, args: list[str], dashboard_url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOTRON_DASHBOARD_URL": dashboard_url}
    env.pop("NANOTRON_DASHBOARD_TOKEN", None)
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def metrics_file(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def numeric(rec: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in rec.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def points(d: Dashboard, run_id: str) -> dict[int, dict[str, float]]:
    """The full-fidelity CSV export: step -> {metric: value}."""
    with urllib.request.urlopen(f"{d.url}/api/runs/{run_id}/metrics.csv", timeout=10) as r:
        rows = list(csv.DictReader(io.StringIO(r.read().decode())))
    return {int(row.pop("step")): {k: float(v) for k, v in row.items() if v != ""} for row in rows}


@dataclass
class FirstRun:
    dashboard: Dashboard
    cwd: Path
    command: list[str]
    records: list[dict]
    run: dict


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("e2e")
    (cwd / "cfg.yaml").write_text(yaml.safe_dump(tiny_config()))
    d = start_dashboard(cwd / "runs.db")
    try:
        # The launcher's form, as the dashboard records any torchrun launch for resuming.
        command = [sys.executable, "-m", "nanotron_train.launch", *LAUNCH[3:], "--config-file", "cfg.yaml"]  # fmt: skip
        train(cwd, command, d.url)
        runs = d.get("/api/runs")
        assert len(runs) == 1
        yield FirstRun(d, cwd, command, metrics_file(cwd / "metrics.jsonl"), runs[0])
    finally:
        d.stop()


def test_run_finished_with_every_point_of_the_metrics_file(first_run):
    run, d = first_run.run, first_run.dashboard
    assert run["status"] == "finished" and run["step"] == STEPS
    assert run["project"] == "e2e" and run["name"] == "tiny"
    assert run["id"].startswith("e2e-tiny-")
    info = d.get(f"/api/runs/{run['id']}")
    assert info["world_size"] == 2 and info["topology"] == {"dp": 1, "tp": 1, "pp": 2}
    assert info["command"] == first_run.command  # the launcher's command, not a worker's argv
    assert info["cwd"] == str(first_run.cwd)
    assert info["config"]["tokens"]["train_steps"] == STEPS
    recs = first_run.records
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    got = points(d, run["id"])
    assert sorted(got) == list(range(1, STEPS + 1))
    for rec in recs:  # every metric, exactly (floats stored at full precision)
        assert got[rec["step"]] == numeric(rec)


def test_checkpoints_listed_and_resume_continues_the_run(first_run):
    d, cwd, run_id = first_run.dashboard, first_run.cwd, first_run.run["id"]
    cks = d.get(f"/api/runs/{run_id}/checkpoints")
    assert [c["step"] for c in cks] == [3, 6]
    assert all(c["complete"] for c in cks)
    ck3 = cks[0]
    assert Path(ck3["path"]).resolve() == (cwd / "ck" / "3").resolve()
    # Checkpoint 6 follows 3 in the same folder: the resumed run saves into a sibling folder
    # (the trainer never writes over a newer checkpoint); the newest resumes in place.
    branch = f"checkpoints.checkpoints_path={Path(ck3['path']).parent}-from-3"
    expected = [*first_run.command, "--resume", ck3["path"], "--override", branch]
    assert ck3["resume_command"] == shlex.join(expected)
    assert cks[1]["resume_command"] == shlex.join([*first_run.command, "--resume", cks[1]["path"]])
    assert ck3["consumed_tokens"] == first_run.records[2]["consumed_tokens"]

    newest_before = (cwd / "ck" / "6" / "checkpoint_metadata.json").read_bytes()
    # Resume from the listed checkpoint, as the copy button's command does.
    train(cwd, shlex.split(ck3["resume_command"]), d.url)
    runs = {r["id"]: r for r in d.get("/api/runs")}
    assert len(runs) == 2
    (child_id,) = set(runs) - {run_id}
    child = d.get(f"/api/runs/{child_id}")
    assert child["status"] == "finished"
    assert child["resumed_from"] == {"run_id": run_id, "step": 3}
    # The metrics file was appended to: the child has only its own steps 4..6, and they
    # continue the parent exactly.
    recs = metrics_file(cwd / "metrics.jsonl")[STEPS:]
    assert [r["step"] for r in recs] == [4, 5, 6]
    got = points(d, child_id)
    assert sorted(got) == [4, 5, 6]
    for rec, parent in zip(recs, first_run.records[3:]):
        assert got[rec["step"]] == numeric(rec)
        assert rec["lm_loss"] == pytest.approx(parent["lm_loss"], rel=1e-6)
        assert rec["consumed_tokens"] == parent["consumed_tokens"]
    assert points(d, run_id) == {r["step"]: numeric(r) for r in first_run.records}
    assert (cwd / "ck-from-3" / "6" / "checkpoint_metadata.json").is_file()
    assert (cwd / "ck" / "6" / "checkpoint_metadata.json").read_bytes() == newest_before


def test_dashboard_down_changes_nothing_but_one_warning(first_run, tmp_path):
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tiny_config()))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = train(tmp_path, [*LAUNCH, "-m", "nanotron_train", "--config-file", "cfg.yaml"], url)
    recs = metrics_file(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for rec, ref in zip(recs, first_run.records):
        assert (rec["lm_loss"], rec["grad_norm"]) == (ref["lm_loss"], ref["grad_norm"])
    warnings = [line for line in proc.stderr.splitlines() if "dashboard at" in line]
    assert len(warnings) == 1 and "unreachable" in warnings[0] and url in warnings[0]
    assert (tmp_path / "ck" / "6" / "checkpoint_metadata.json").is_file()


def test_dashboard_killed_and_restarted_mid_run_keeps_every_step(tmp_path):
    """SIGKILL the dashboard while a real 2-process run streams to it, start it again on the
    same port and database: when the run ends the database holds every step, exactly."""
    import time

    steps = 300
    cfg = tiny_config()
    cfg["tokens"]["train_steps"] = steps
    cfg["checkpoints"].update(checkpoints_path=None)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    d = start_dashboard(tmp_path / "runs.db")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOTRON_DASHBOARD_URL": d.url}
    env.pop("NANOTRON_DASHBOARD_TOKEN", None)
    command = [*LAUNCH, "-m", "nanotron_train", "--config-file", "cfg.yaml"]
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    restarted = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until the run is streaming
            runs = d.get("/api/runs")
            if runs and (runs[0]["step"] or 0) >= 3:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the run never reached the dashboard")
        d.kill()
        restarted = start_dashboard(tmp_path / "runs.db", port=d.port)
        at_restart = len((tmp_path / "metrics.jsonl").read_text().splitlines())
        assert at_restart < steps, "the run ended before the dashboard came back"
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        records = metrics_file(tmp_path / "metrics.jsonl")
        run_id = restarted.get("/api/runs")[0]["id"]
        got = points(restarted, run_id)
        assert sorted(got) == list(range(1, steps + 1))
        for rec in records:
            assert got[rec["step"]] == numeric(rec)
        assert restarted.get(f"/api/runs/{run_id}")["status"] == "finished"
    finally:
        if proc.poll() is None:
            proc.kill()
        d.stop()
        if restarted is not None:
            restarted.stop()
