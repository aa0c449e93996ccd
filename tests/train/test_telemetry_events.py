"""Every event kind the trainer sends, each from a run made to trigger it, as the dashboard
receives it (a fake ingest): non-finite loss, loss and grad-norm spikes (one process), a
throughput drop and a preemption (torchrun, a worker paused, then signalled, from outside).
The stall event of the hang watchdog is checked in test_fault_tolerance.py."""

from __future__ import annotations

import math
import signal
import statistics
import time

import pytest

from nanotron_train.fault.errors import TrainingStopped
from tests.train.fault_helpers import Torchrun, kill, records, wait_step, write_config
from tests.train.telemetry_helpers import FakeIngest
from tests.train.test_fault_policies import config, train


@pytest.fixture
def ingest(monkeypatch):
    fake = FakeIngest()
    monkeypatch.setenv("NANOTRON_DASHBOARD_URL", fake.url)
    yield fake
    fake.close()
    assert fake.refused() == []  # every message is one the real dashboard accepts


def test_nonfinite_steps_and_spikes_are_events(ingest):
    raw = config(
        None, 12,
        fault_tolerance={"nonfinite_policy": "skip", "loss_spike_window": 8,
                         "grad_norm_spike_window": 8},
        logging={"throughput_drop_fraction": 0.01},  # a loaded machine's slow step is no event here
    )  # fmt: skip
    recs, _, _ = train(raw, {3: math.nan, 4: math.inf, 12: 30.0})
    nonfinite = ingest.events("nonfinite_loss")
    assert [(e["step"], e["severity"]) for e in nonfinite] == [(3, "critical"), (4, "critical")]
    assert nonfinite[0]["details"]["action"] == "skip"
    assert "optimizer step skipped" in nonfinite[0]["message"]
    (loss,) = ingest.events("loss_spike")
    (norm,) = ingest.events("grad_norm_spike")
    assert loss["step"] == norm["step"] == 12
    assert loss["details"]["z"] == recs[11]["loss_spike_z"] > 6
    assert norm["details"]["z"] == recs[11]["grad_norm_spike_z"] > 6
    assert norm["details"]["grad_norm"] == recs[11]["grad_norm"]
    assert all("grad_norm_spike_z" not in r for r in recs[:11])
    kinds = {e["kind"] for e in ingest.events()}
    assert kinds == {"nonfinite_loss", "loss_spike", "grad_norm_spike"}, ingest.events()


def test_nonfinite_stop_is_a_critical_event_before_the_failed_end(ingest):
    raw = config(None, 6, fault_tolerance={"nonfinite_policy": "stop"})
    with pytest.raises(TrainingStopped):
        train(raw, {3: math.nan})
    (event,) = ingest.events("nonfinite_loss")
    assert event["step"] == 3 and event["severity"] == "critical"
    assert event["message"].startswith("non-finite values at step 3: lm_loss=nan")
    types = [m["type"] for m in ingest.messages]
    assert types.index("event") < types.index("run_end")
    assert ingest.of_type("run_end")[0]["status"] == "failed"


def test_throughput_drop_and_preemption_are_events(tmp_path, ingest):
    # a 10x drop: the load of a shared machine does not make one, a paused step does
    cfg = write_config(tmp_path, "pre", 100_000, interval=100_000,
                       logging={"throughput_drop_fraction": 0.1})  # fmt: skip
    run = Torchrun(cfg, env={"NANOTRON_DASHBOARD_URL": ingest.url})
    metrics = tmp_path / "pre.jsonl"
    try:
        workers = run.wait_workers()
        wait_step(metrics, 12, run)
        recent = records(metrics)[-10:]
        before = max(r["step"] for r in recent)
        # rank 1 paused: rank 0 waits for it in its next tp collective, inside a timed step.
        # The pause is sized from the steps just measured: even split across two steps, each
        # is 20x its median, so a loaded machine's slower steps cannot hide the drop.
        step_s = statistics.median(r["time_per_iteration_ms"] for r in recent) / 1000
        kill(workers[1], signal.SIGSTOP)
        time.sleep(min(max(1.5, 40 * step_s), 60.0))
        kill(workers[1], signal.SIGCONT)
        wait_step(metrics, before + 6, run)
        kill(workers[0], signal.SIGTERM)
        assert run.wait() == 0, run.output()[-4000:]
    finally:
        run.kill_all()
    drops = [e for e in ingest.events("throughput_drop") if e["step"] > before]
    assert drops, (ingest.events(), run.output()[-3000:])
    slow = next(r for r in records(metrics) if r["step"] == drops[0]["step"])
    assert drops[0]["details"]["tokens_per_sec"] == slow["tokens_per_sec"]
    assert drops[0]["details"]["ratio"] < 0.1 and drops[0]["severity"] == "warning"
    (pre,) = ingest.events("preemption")
    assert pre["details"]["signal"] == "SIGTERM" or pre["details"]["signal"] is None
    last = max(r["step"] for r in records(metrics))
    assert pre["step"] == last and pre["details"]["saved_step"] == last
    kinds = [m.get("kind") or m["type"] for m in ingest.messages]
    assert kinds.index("preemption") < kinds.index("run_end")
    assert ingest.of_type("run_end")[0]["status"] == "preempted"
    assert f"throughput_drop: {drops[0]['message']}" in run.output()
