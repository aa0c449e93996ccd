"""Fault tolerance with real torchrun launches and real signals (issue 16).

One tiny Llama under tp=2. The uninterrupted reference run is shared; the same run survives a
SIGKILLed worker (torchrun --max-restarts, --resume auto) and a SIGTERM (preemption) and must
log bitwise the reference's losses at every step, whichever attempt logged it.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.dashboard.dashboard_helpers import start_dashboard
from tests.train.fault_helpers import (
    Torchrun,
    alive,
    kill,
    losses_by_step,
    wait_step,
    write_config,
)
from tests.train.telemetry_helpers import FakeIngest

STEPS = 24


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    cfg = write_config(tmp, "ref", STEPS, interval=4)
    run = Torchrun(cfg)
    assert run.wait() == 0, run.output()[-4000:]
    return losses_by_step(tmp / "ref.jsonl")


def test_sigkill_restart_and_sigterm_preemption_continue_bitwise(tmp_path, reference):
    cfg = write_config(tmp_path, "ft", STEPS, interval=4)
    metrics, ck = tmp_path / "ft.jsonl", tmp_path / "ft-ck"
    dash = start_dashboard(tmp_path / "runs.db")
    env = {"NANOTRON_DASHBOARD_URL": dash.url}
    try:
        _restart_and_preempt(cfg, metrics, ck, reference, env, dash)
    finally:
        dash.stop()


def _restart_and_preempt(cfg, metrics, ck, reference, env, dash):
    run = Torchrun(cfg, "--resume", "auto", restarts=3, env=env, launcher=True)
    try:
        first = run.wait_workers()
        kill_at = random.Random().randint(5, 10)  # after the checkpoint of step 4
        wait_step(metrics, kill_at, run)
        kill(first[1], signal.SIGKILL)  # a dead worker: torchrun restarts the group
        run.wait_workers(exclude=set(first.values()))
        seen = wait_step(metrics, 0, run)
        # The restarted attempt resumed from the last checkpoint and trains on; now preempt
        # it as a batch scheduler does: SIGTERM to the launcher's process group (torchrun's
        # workers sit in sessions of their own: the launcher passes the signal on). The
        # workers save and exit 0, and so does the launch, without a traceback.
        wait_step(metrics, 14, run, after=seen)
        os.killpg(run.proc.pid, signal.SIGTERM)
        assert run.wait() == 0, run.output()[-4000:]
    finally:
        run.kill_all()
    out = run.output()
    assert "launcher: SIGTERM received: passed to the 2 workers" in out, out[-4000:]
    after_signal = out[out.index("launcher: SIGTERM received") :]  # (the SIGKILL left one)
    assert "Traceback" not in after_signal and "SignalException" not in out, out[-4000:]
    assert "SIGTERM received" in out and "resumed from" in out, out[-4000:]
    assert "--resume auto: no checkpoint" in out  # the first attempt started fresh
    logged = losses_by_step(metrics)
    stopped = max(logged)
    assert 14 <= stopped < STEPS, out[-4000:]
    assert (ck / "latest.txt").read_text().strip() == str(stopped)  # saved at the preemption
    (only,) = dash.get("/api/runs")  # the restart continued the run: one run
    assert only["status"] == "preempted", only

    again = Torchrun(cfg, "--resume", "auto", env=env)
    assert again.wait() == 0, again.output()[-4000:]
    assert f"resumed from {ck / str(stopped)} at step {stopped}" in again.output()
    logged = losses_by_step(metrics)
    assert sorted(logged) == list(range(1, STEPS + 1))
    replayed = [s for s, values in logged.items() if len(values) > 1]
    assert replayed, "the SIGKILL should have made the restart log some steps again"
    for step, values in logged.items():  # every attempt's value is the uninterrupted one
        assert values == [reference[step][0]] * len(values), (step, values, reference[step])
    (only,) = dash.get("/api/runs")
    run_page = dash.get(f"/api/runs/{only['id']}")
    assert run_page["status"] == "finished" and len(run_page["attempts"]) == 3, run_page
    assert run_page["step"] == STEPS


def test_sigstop_of_one_worker_fails_every_rank_naming_it(tmp_path):
    timeout = 4
    dumps = tmp_path / "stacks"
    cfg = write_config(
        tmp_path,
        "hang",
        100_000,
        interval=100_000,
        parallelism={"collective_timeout_s": timeout},
        fault_tolerance={"stack_dump_dir": str(dumps)},
    )
    ingest = FakeIngest()  # the dashboard gets the watchdog's finding as a `stall` event
    run = Torchrun(cfg, env={"NANOTRON_DASHBOARD_URL": ingest.url})
    try:
        workers = run.wait_workers()
        wait_step(tmp_path / "hang.jsonl", 3, run)
        kill(workers[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        while alive(workers[0]) and time.monotonic() - stopped_at < timeout + 60:
            time.sleep(0.1)
        elapsed = time.monotonic() - stopped_at
        assert not alive(workers[0]), "rank 0 still runs a minute after its peer stopped"
        kill(workers[1], signal.SIGKILL)
        assert run.wait() != 0
    finally:
        run.kill_all()
        ingest.close()
    out = run.output()
    assert elapsed < timeout + 30, (elapsed, out[-3000:])
    assert ingest.refused() == []
    (stall,) = ingest.events("stall")
    assert stall["severity"] == "critical" and "collective timeout at step" in stall["message"]
    assert stall["details"]["rank"] == 1 and stall["details"]["ranks"] == [1]
    assert stall["details"]["phase"] in ("tp", "optimizer", "loss dp all-reduce")
    assert stall["step"] == stall["details"]["step"] >= 3
    lines = [line for line in out.splitlines() if "collective timeout at step" in line]
    assert lines, out[-4000:]
    line = lines[0]
    assert "rank 0 waited" in line and "for rank 1 (no heartbeat" in line, line
    assert any(f" in {phase} for " in line for phase in ("tp", "optimizer", "loss")), line
    stacks = (dumps / "stacks-rank0.txt").read_text()
    assert "Thread" in stacks and "nanotron-watchdog" not in stacks.splitlines()[0]
    assert "File " in stacks and "nanotron_" in stacks


def test_sigkill_of_torchrun_leaves_no_worker(tmp_path):
    cfg = write_config(tmp_path, "orphan", 100_000, interval=100_000)
    run = Torchrun(cfg)
    try:
        workers = run.wait_workers()
        wait_step(tmp_path / "orphan.jsonl", 2, run)
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait()
        killed_at = time.monotonic()
        while any(alive(p) for p in workers.values()) and time.monotonic() - killed_at < 30:
            time.sleep(0.1)
        left = [p for p in workers.values() if alive(p)]
        elapsed = time.monotonic() - killed_at
    finally:
        for pid in workers.values():
            kill(pid, signal.SIGKILL)
    assert not left and elapsed < 10, (left, elapsed)
    out = run.output()  # whichever noticed first: the parent watch or the store
    assert "died; exiting" in out or "the launcher's store does not answer" in out, out[-3000:]
