"""A run that finished exits 0, every time, and the dashboard hears `finished` only then.

The abort at exit ("terminate called without an active exception", SIGABRT after the last
step) came from interpreter finalization: a daemon thread inside a C++ call with the GIL
released (a torch op, a store request) is ended by pthread_exit inside a C++ destructor when it
wakes after finalization began. Here every worker carries such a thread on purpose (a
sitecustomize that keeps a daemon thread in torch matmuls: a library's thread we cannot join),
and runs every feature of ours that starts a thread or asynchronous work: async TP, async
checkpoint saves, the data prefetch thread, telemetry, the dashboard client (to a live ingest),
the hang watchdog, the launcher watch. A launch of 4 such workers (4 training and 4 library
threads busy on the machine's cores) must exit 0 with no abort. Without process_exit.py workers
abort (SIGABRT) and the launch fails, run after run: one launch catches it, a second concurrent
one only added start-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.train.telemetry_helpers import FakeIngest
from tests.train.test_checkpoint import tiny_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6

# Imported by every Python process started with this folder on PYTHONPATH; only torchrun
# workers (RANK set) start the thread, so the launcher itself is left as it is.
SITECUSTOMIZE = """
import os, threading
if "RANK" in os.environ:
    def _busy():
        import torch
        a = torch.randn(256, 256)
        while True:
            a @ a
    threading.Thread(target=_busy, name="library-thread", daemon=True).start()
"""


def _config(tmp: Path, name: str, dashboard: str) -> Path:
    raw = tiny_config({"dp": 1, "tp": 2, "pp": 2}, str(tmp / f"{name}-ck"), steps=STEPS)
    raw["parallelism"].update(tp_mode="REDUCE_SCATTER", tp_linear_async_communication=True)
    raw["checkpoints"].update(checkpoint_interval=2, async_save=True)
    raw["data_stages"][0]["data"]["num_loading_workers"] = 2
    raw["logging"].update(
        metrics_file=str(tmp / f"{name}.jsonl"),
        dashboard_url=dashboard,
        rank_stats_interval=2,
        pipeline_timeline_interval=3,
    )
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_finished_runs_exit_0_with_a_library_thread_busy_in_torch(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    ingest = FakeIngest()
    cfg = _config(tmp_path, "run", ingest.url)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        "-m", "nanotron_train", "--config-file", str(cfg),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)  # fmt: skip
    out = proc.stdout
    assert "terminate called" not in out and "Fatal Python error" not in out, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    steps = [yaml.safe_load(line)["step"] for line in (tmp_path / "run.jsonl").open()]
    assert steps == list(range(1, STEPS + 1))
    assert (tmp_path / "run-ck" / "latest.txt").read_text().strip() == str(STEPS)
    ends = ingest.of_type("run_end")
    assert [e["status"] for e in ends] == ["finished"], ends


def test_a_failing_teardown_reports_the_run_failed(tmp_path, monkeypatch):
    """run_end goes out after the process groups are torn down: a teardown that fails turns
    the run's status to failed (the dashboard never shows finished for a failed process)."""
    import pytest

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import train

    ingest = FakeIngest()
    raw = tiny_config({"dp": 1, "tp": 1, "pp": 1}, str(tmp_path / "ck"), steps=2)
    raw["logging"].update(dashboard_url=ingest.url)

    real_destroy = ParallelContext.destroy

    def broken_destroy(self):  # tears down for real (later tests need no default group)
        real_destroy(self)
        raise RuntimeError("teardown failed")

    monkeypatch.setattr(ParallelContext, "destroy", broken_destroy)
    with pytest.raises(RuntimeError, match="teardown failed"):
        train(config_from_dict(raw))
    (end,) = ingest.of_type("run_end")
    assert end["status"] == "failed" and "teardown failed" in end["error"], end
