"""Per-rank telemetry of a real 4-process run (dp=2 x pp=2), as the dashboard receives it.

One launch, shared by the tests: a fake ingest records every message; from outside, the test
SIGSTOPs and SIGCONTs one worker (rank 3: dp=1, pp=1) in a loop, stopped 60 ms of every 70 (the
tiny model's intervals are 4-25 ms of work: a lighter duty cycle lands on its compute in some
intervals only, and the detector rightly waits), which makes it a straggler.
"""

from __future__ import annotations

import socket

import pytest

from tests.train.fault_helpers import records
from tests.train.telemetry_helpers import FakeIngest, Torchrun4, telemetry_config

LAYOUT = {"dp": 2, "tp": 1, "pp": 2}
STEPS, INTERVAL, TIMELINE_EVERY, M = 40, 2, 10, 2
SLOW_RANK = 3  # ranks are pp-major, tp fastest: rank 3 is dp=1, tp=0, pp=1


def coordinates(rank: int) -> dict:
    dp, tp = LAYOUT["dp"], LAYOUT["tp"]
    return {"dp": (rank // tp) % dp, "tp": rank % tp, "pp": rank // (dp * tp), "cp": 0}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("telemetry")
    ingest = FakeIngest()
    cfg = telemetry_config(
        tmp, "run", LAYOUT, STEPS,
        tokens={"micro_batch_size": 1, "batch_accumulation_per_replica": M},
        rank_stats_interval=INTERVAL,  # the straggler detector's defaults (margin 0.5, 6)
        pipeline_timeline_interval=TIMELINE_EVERY,
    )  # fmt: skip
    run = Torchrun4(cfg, ingest.url)
    try:
        status = run.wait_with_a_slowed_rank(SLOW_RANK, 0.06, 0.01, after=tmp / "run.jsonl")
    finally:
        ingest.close()
    assert status == 0, run.output()[-4000:]
    ingest.config = cfg  # the run's config, for the prediction's test
    return ingest, run.output(), records(tmp / "run.jsonl")


def test_rank_stats_name_every_rank_with_its_coordinates_and_shares(launch):
    ingest, _, _ = launch
    msgs = ingest.of_type("rank_stats")
    assert [m["step"] for m in msgs] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    for m in msgs:
        assert m["interval"] == INTERVAL and m["run_id"] and m["time"] > 0
        assert [r["rank"] for r in m["ranks"]] == [0, 1, 2, 3]
        for r in m["ranks"]:
            assert {k: r[k] for k in ("dp", "tp", "pp", "cp")} == coordinates(r["rank"])
            assert r["host"] == socket.gethostname()
            shares = [r[k] for k in ("compute_ms", "tp_comm_ms", "pp_wait_ms", "dp_wait_ms",
                                     "optimizer_ms", "data_ms")]  # fmt: skip
            assert all(s >= 0 for s in shares), r
            # the shares are measured inside the step: together they cannot exceed it
            assert sum(shares) <= r["step_ms"] * 1.0001, r
            assert r["tp_comm_ms"] == 0.0  # tp = 1: no tp collective ran
            assert r["pp_wait_ms"] > 0 and r["compute_ms"] > 0 and r["optimizer_ms"] > 0
            assert r["mem_bytes"] > 10**7 and r["mem_reserved_bytes"] is None  # RSS on CPU
            assert r["gpu_util_pct"] is None and r["gpu_power_w"] is None
            assert r["cpu_util_pct"] is not None and r["cpu_util_pct"] >= 0


def test_a_rank_slowed_from_outside_is_named_a_straggler(launch):
    ingest, out, _ = launch
    events = ingest.events("straggler")
    named = [e for e in events if e["details"]["rank"] == SLOW_RANK]
    assert named, (events, out[-3000:])
    e = named[0]
    want = {"rank": SLOW_RANK, "host": socket.gethostname(), **coordinates(SLOW_RANK)}
    assert {k: e["details"][k] for k in want} == want
    assert e["severity"] == "warning" and e["details"]["ratio"] > 1.5
    assert e["message"].startswith(f"rank 3 (dp=1 tp=0 pp=1, host {socket.gethostname()})")
    assert e["step"] % INTERVAL == 0 and e["step"] >= 6 * INTERVAL  # a full window of 6
    assert f"straggler: {e['message']}" in out  # and one log line


def test_pipeline_timeline_spans_are_complete_and_ordered(launch):
    ingest, out, _ = launch
    msgs = ingest.of_type("pipeline_timeline")
    assert [m["step"] for m in msgs] == list(range(TIMELINE_EVERY, STEPS + 1, TIMELINE_EVERY))
    for m in msgs:
        assert (m["schedule"], m["pp"], m["chunks"], m["micro_batches"]) == ("1f1b", 2, 1, M)
        assert m["bubble_formula"] == pytest.approx(1 / (M + 1))
        # the stage clocks, aligned at the barrier: rank 0's is the reference; on one host the
        # bounds of the other's offset are what the all-gathers took (well under a second)
        assert m["clock"]["offsets_ms"][0] == 0.0 and len(m["clock"]["offsets_ms"]) == 2
        assert m["clock"]["uncertainty_ms"][0] == 0.0 and 0 < m["clock"]["uncertainty_ms"][1] < 1000
        if m["clock"]["order_violations"]:  # rank clocks that disagree: flagged, no bubble
            assert m["bubble_measured"] is None and "no bubble measured" in out
            continue
        assert 0.0 <= m["bubble_measured"] < 1.0
        keys = [(s["stage"], s["chunk"], s["micro_batch"], s["kind"]) for s in m["spans"]]
        want = {(st, 0, mb, k) for st in (0, 1) for mb in range(M) for k in ("forward", "backward")}
        assert sorted(keys) == sorted(want)  # every one, once
        for stage in (0, 1):
            spans = [s for s in m["spans"] if s["stage"] == stage]
            assert all(0 <= s["start_ms"] <= s["end_ms"] for s in spans)
            ends = [s["end_ms"] for s in spans][:-1]
            assert all(a <= b["start_ms"] for a, b in zip(ends, spans[1:]))  # one at a time
            kinds = [(s["kind"], s["micro_batch"]) for s in spans]
            # 1F1B order of this stage (warm-up pp - stage - 1 forwards)
            if stage == 1:
                assert kinds == [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]
            else:
                assert kinds == [("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)]
        busy = {
            st: sum(s["end_ms"] - s["start_ms"] for s in m["spans"] if s["stage"] == st)
            for st in (0, 1)
        }
        end = max(s["end_ms"] for s in m["spans"])
        want_bubble = sum(1 - busy[st] / end for st in (0, 1)) / 2
        assert m["bubble_measured"] == pytest.approx(want_bubble)
        line = f"pipeline timeline at step {m['step']}: bubble {m['bubble_measured']:.3f} measured"
        assert line in out


def test_rank0_records_carry_system_metrics(launch):
    ingest, _, recs = launch
    assert len(recs) == STEPS
    for rec in recs[1:]:  # the first may come before the clock ticked (10 ms)
        assert 0 <= rec["system/cpu_util_pct"] <= 100
        assert rec["system/rss_bytes"] > 10**7
        assert "system/gpu_util_pct" not in rec  # no NVML on the CPU
    sent = {m["step"]: m["values"] for m in ingest.of_type("metrics")}
    assert sent[STEPS]["system/rss_bytes"] == recs[-1]["system/rss_bytes"]


def test_every_message_passes_the_dashboard_validation(launch):
    ingest, _, _ = launch
    kinds = {m["type"] for m in ingest.messages}
    assert {"rank_stats", "pipeline_timeline", "event", "metrics", "run_end", "prediction"} <= kinds
    assert ingest.refused() == []


def test_the_planner_s_prediction_of_the_run_s_layout_is_sent_once(launch):
    """What the dashboard shows next to the measurement: the planner's prediction for this
    run's own layout (dp2 x pp2 1f1b) on the device it plans on (here the `cpu` row)."""
    from nanotron_train.config import load_config
    from nanotron_train.plan.auto import local_device
    from nanotron_train.plan.enumerate import predict

    ingest, _, _ = launch
    (msg,) = ingest.of_type("prediction")
    assert msg["run_id"] == ingest.of_type("run_start")[0]["run_id"] and msg["step"] == 0
    p = predict(load_config(ingest.config), local_device(4), 4, 4)
    assert msg["device"] == "cpu" and msg["memory_bytes"] == p.memory.total
    assert msg["step_ms"] == pytest.approx(1000 * p.time.total, rel=1e-12)
    assert msg["idle_ms"] == pytest.approx(1000 * p.time.idle, rel=1e-12) and msg["idle_ms"] > 0
    parts = msg["compute_ms"] + msg["comm_ms"] + msg["idle_ms"] + msg["optimizer_ms"]
    assert parts == pytest.approx(msg["step_ms"], rel=1e-12)
