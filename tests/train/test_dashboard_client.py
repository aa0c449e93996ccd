"""The trainer's dashboard client against a real dashboard, driven by a fake training loop."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "dashboard"))
from dashboard_helpers import free_port, start_dashboard  # noqa: E402

from nanotron_train.reporting.dashboard_client import DashboardClient, ingest_url  # noqa: E402
from nanotron_train.reporting.dashboard_sink import client_from_config  # noqa: E402


@pytest.fixture(scope="module")
def live_dashboard(tmp_path_factory):
    d = start_dashboard(tmp_path_factory.mktemp("dash") / "runs.db")
    yield d
    d.stop()


CMD = ["torchrun", "--nproc_per_node=2", "-m", "nanotron_train", "--config-file", "tiny.yaml"]


def record(step: int) -> dict:
    loss = 11.0 / (1 + step) if step != 7 else float("nan")
    return {
        "step": step,
        "consumed_tokens": 128 * step,
        "lm_loss": loss,
        "grad_norm": 0.5 + step % 3,
        "lr": 3e-4 * min(1.0, step / 10),
        "tokens_per_sec": 1000.0 + step,
    }


def fake_trainer(
    client: DashboardClient, metrics_file: Path, steps: range, pause: float = 0.0, hook=None
):
    """What the real trainer does per logged step: append to the metrics file, then send.

    Returns the total time spent inside client.metrics()."""
    spent = 0.0
    with open(metrics_file, "a") as f:
        for step in steps:
            rec = record(step)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            t0 = time.perf_counter()
            client.metrics(step, {k: v for k, v in rec.items() if k != "step"})
            dt = time.perf_counter() - t0
            assert dt < 0.1, f"metrics() blocked for {dt:.3f} s"
            spent += dt
            if hook:
                hook(step)
            time.sleep(pause)
    return spent


def start_run(client: DashboardClient, tmp_path: Path) -> None:
    client.run_start(
        project="tests",
        name="fake",
        config={"tokens": {"train_steps": 100}},
        world_size=2,
        topology={"dp": 2, "tp": 1, "pp": 1},
        command=CMD,
        cwd=str(tmp_path),
        checkpoints_path=str(tmp_path / "ck"),
    )


def db_points(dash, run_id: str) -> dict[int, dict[str, float]]:
    """Every stored point, read back through the full-fidelity CSV export."""
    import urllib.request

    with urllib.request.urlopen(f"{dash.url}/api/runs/{run_id}/metrics.csv", timeout=10) as r:
        lines = r.read().decode().splitlines()
    header = lines[0].split(",")
    out = {}
    for line in lines[1:]:
        cells = line.split(",")
        out[int(cells[0])] = {h: float(c) for h, c in zip(header[1:], cells[1:]) if c}
    return out


def file_points(path: Path) -> dict[int, dict[str, float]]:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        step = rec.pop("step")
        out[step] = {k: float(v) for k, v in rec.items()}
    return out


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        a[s].keys() == b[s].keys()
        and all(a[s][k] == b[s][k] or (math.isnan(a[s][k]) and math.isnan(b[s][k])) for k in a[s])
        for s in a
    )


def wait_for(fn, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.1)
    return False


def test_stream_points_equal_metrics_file(live_dashboard, tmp_path):
    mf = tmp_path / "metrics.jsonl"
    c = DashboardClient(
        live_dashboard.url, run_id="stream-1", metrics_file=str(mf), heartbeat_s=0.5
    )
    start_run(c, tmp_path)
    fake_trainer(c, mf, range(1, 61))
    c.checkpoint(
        {
            "step": 60,
            "path": str(tmp_path / "ck" / "60"),
            "consumed_tokens": 7680,
            "topology": {"dp": 2, "tp": 1, "pp": 1},
        }
    )
    c.run_end("finished")
    c.close()
    assert same(db_points(live_dashboard, "stream-1"), file_points(mf))
    run = live_dashboard.get("/api/runs/stream-1")
    assert run["status"] == "finished" and run["step"] == 60 and run["world_size"] == 2
    cks = live_dashboard.get("/api/runs/stream-1/checkpoints")
    assert [(k["step"], k["consumed_tokens"]) for k in cks] == [(60, 7680)]
    assert cks[0]["resume_command"].endswith("--resume " + str(tmp_path / "ck" / "60"))


def test_kill_and_restart_dashboard_mid_stream(tmp_path, caplog):
    db = tmp_path / "runs.db"
    port = free_port()
    dash = start_dashboard(db, port=port)
    mf = tmp_path / "metrics.jsonl"
    c = DashboardClient(
        dash.url, run_id="crash-1", metrics_file=str(mf), heartbeat_s=0.3, queue_size=50
    )
    start_run(c, tmp_path)
    state = {}

    def hook(step):
        if step == 40:
            dash.kill()  # SIGKILL mid-stream: whatever the writer had queued is gone
        if step == 120:
            state["dash"] = start_dashboard(db, port=port)

    with caplog.at_level(logging.WARNING, logger="nanotron_train.dashboard"):
        fake_trainer(c, mf, range(1, 201), pause=0.005, hook=hook)
        c.run_end("finished")
        c.close(timeout=15)
    dash2 = state["dash"]
    try:
        assert wait_for(lambda: dash2.get("/api/runs/crash-1")["status"] == "finished")
        assert same(db_points(dash2, "crash-1"), file_points(mf))
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    finally:
        dash2.stop()


def loads(step: int) -> dict[str, list[int]]:
    """A record's expert loads (2 MoE layers of 4 experts), different at every step."""
    return {str(layer): [step, 2 * step + layer, 3, 100 - step] for layer in (0, 1)}


def stored_loads(dash, run_id: str) -> dict[int, dict[str, list[int]]]:
    """Every stored step's loads per layer, read back through the heatmap's endpoint."""
    out: dict[int, dict[str, list[int]]] = {}
    for layer in (0, 1):
        got = dash.get(f"/api/runs/{run_id}/moe_load?layer={layer}&max_steps=5000")
        for step, counts in zip(got["steps"], got["counts"]):
            out.setdefault(step, {})[str(layer)] = counts
    return out


PREDICTION = {
    "step": 0, "device": "cpu", "device_source": "placeholder", "memory_bytes": 123456,
    "step_ms": 2.5, "compute_ms": 1.5, "comm_ms": 0.5, "idle_ms": 0.0, "optimizer_ms": 0.5,
}  # fmt: skip


@pytest.mark.parametrize("with_file", [True, False], ids=["metrics-file", "in-memory"])
def test_moe_load_is_replayed_after_an_outage(tmp_path, with_file):
    """The dashboard is killed mid-run and restarted while the logging rank's sinks log each
    step's record with its expert loads: every step's loads are stored after it, as the
    scalars are (replayed from the metrics file, or from memory without one), whether their
    queued message was dropped (the bounded telemetry queue) or lost in flight. The planner's
    prediction, sent during the outage, is kept until sent (never dropped as the oldest
    telemetry)."""
    from nanotron_train.reporting.metrics import MetricsLogger, RunInfo

    db, port = tmp_path / "runs.db", free_port()
    dash = start_dashboard(db, port=port)
    info = RunInfo("tests", "moe", {}, 2, {"dp": 2, "tp": 1, "pp": 1}, command=CMD)
    mf = str(tmp_path / "metrics.jsonl") if with_file else None
    logger = MetricsLogger(mf, stream=None, dashboard_url=dash.url, run=info, run_id="moe-1")
    client = logger._dashboard
    client.queue_size, client.heartbeat_s = 50, 0.3
    client.telemetry_queue = 8  # fewer than the outage's steps: queued loads are dropped
    for step in range(1, 81):
        logger.log({**record(step), "moe_load": loads(step)})
        if step == 20:
            dash.kill()  # SIGKILL: whatever the writer had queued is gone
            logger.prediction(PREDICTION)
        if step == 50:
            dash = start_dashboard(db, port=port)
        time.sleep(0.005)
    try:
        assert wait_for(lambda: dash.get("/api/runs/moe-1")["step"] == 80, timeout=30)
        logger.close()
        assert wait_for(lambda: dash.get("/api/runs/moe-1")["status"] == "finished")
        assert client.dropped_telemetry > 0  # the outage did drop queued loads
        assert stored_loads(dash, "moe-1") == {step: loads(step) for step in range(1, 81)}
        predicted = dash.get("/api/runs/moe-1/prediction")["predicted"]
        assert {k: predicted[k] for k in PREDICTION} == PREDICTION
    finally:
        dash.stop()


def test_unreachable_dashboard_never_slows_training(tmp_path, caplog):
    mf = tmp_path / "metrics.jsonl"
    with caplog.at_level(logging.WARNING, logger="nanotron_train.dashboard"):
        c = DashboardClient(
            f"http://127.0.0.1:{free_port()}", run_id="down", metrics_file=str(mf), queue_size=10
        )
        start_run(c, tmp_path)
        spent = fake_trainer(c, mf, range(1, 2001))
        c.run_end("failed", error="boom")
        t1 = time.perf_counter()
        c.close(timeout=2)
    # 2000 steps: the client only appends to a deque (~10 us each when the machine is idle)
    assert spent < 1.0, spent
    assert time.perf_counter() - t1 < 6.0
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1


def test_overflow_without_metrics_file_is_replayed_from_memory(live_dashboard, tmp_path):
    c = DashboardClient(live_dashboard.url, run_id="mem-1", queue_size=5)
    start_run(c, tmp_path)
    for step in range(1, 301):  # far more than the queue holds, as fast as possible
        c.metrics(step, {"lm_loss": 1.0 / step})
    c.close(timeout=15)
    stored = db_points(live_dashboard, "mem-1")
    assert sorted(stored) == list(range(1, 301))
    assert stored[300] == {"lm_loss": 1.0 / 300}


def test_token_is_sent(tmp_path):
    dash = start_dashboard(tmp_path / "t.db", token="s3cret")
    try:
        c = DashboardClient(dash.url, run_id="tok", token="s3cret")
        start_run(c, tmp_path)
        c.metrics(1, {"lm_loss": 2.0})
        c.close()
        assert wait_for(lambda: dash.get("/api/runs/tok")["step"] == 1)
    finally:
        dash.stop()


def test_urls_and_env_override(monkeypatch):
    assert ingest_url("http://127.0.0.1:8008/") == "ws://127.0.0.1:8008/ws/ingest"
    assert ingest_url("https://h.example/dash") == "wss://h.example/dash/ws/ingest"
    with pytest.raises(ValueError, match="expected http"):
        ingest_url("127.0.0.1:8008")
    monkeypatch.delenv("NANOTRON_DASHBOARD_URL", raising=False)
    assert client_from_config(None, run_id="x") is None
    assert client_from_config("not a url", run_id="x") is None  # a warning, not a crash
    monkeypatch.setenv("NANOTRON_DASHBOARD_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("NANOTRON_DASHBOARD_TOKEN", "t")
    c = client_from_config("http://ignored:1", run_id="x", token="other")
    try:
        assert c.ws_url.endswith("/ws/ingest") and "ignored" not in c.ws_url and c.token == "t"
    finally:
        c.close(timeout=0.5)


def test_refused_messages_are_logged_once_and_never_block(live_dashboard, tmp_path, caplog):
    """Issue 13: a message out of the protocol's bounds gets an error frame; the client counts
    it, logs one line (not one per step) and goes on; the connection stays up."""
    c = DashboardClient(live_dashboard.url, run_id="refused-1", heartbeat_s=0.5)
    start_run(c, tmp_path)
    with caplog.at_level(logging.WARNING, logger="nanotron_train.dashboard"):
        for step in range(1, 21):
            c.metrics(step, {"lm_loss": 1.0, "x" * 201: 2.0})  # a name over 200 characters
        c.metrics(21, {"lm_loss": 0.5})
        c.close()
    assert c.refused == 20
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "at most 200 characters" in lines[0].getMessage()
    run = live_dashboard.get("/api/runs/refused-1")
    assert run["step"] == 21 and run["metric_names"] == ["lm_loss"]


def test_layer_stats_reach_the_metrics_file_and_the_dashboard(live_dashboard, tmp_path):
    """A detail step's record (metrics_logging): the file keeps the nested statistics, the
    dashboard stores them per statistic, a NaN kept."""
    from nanotron_train.reporting.metrics import MetricsLogger, RunInfo

    stats = {
        "grad_norm": {"embedding.weight": 0.5, "decoder.0.mlp.down.weight": float("nan")},
        "act_rms": {"embedding": 0.25, "decoder.0": 1.5},
    }
    mf = tmp_path / "metrics.jsonl"
    run = RunInfo(project="tests", name="layers", config={}, world_size=1, topology={})
    logger = MetricsLogger(str(mf), stream=None, dashboard_url=live_dashboard.url, run=run,
                           run_id="layers-1")  # fmt: skip
    logger.log({**record(10), "layer_stats": stats})
    logger.close()
    kept = json.loads(mf.read_text().splitlines()[0])["layer_stats"]
    assert kept["act_rms"] == stats["act_rms"] and math.isnan(
        kept["grad_norm"]["decoder.0.mlp.down.weight"]
    )
    h = live_dashboard.get("/api/runs/layers-1/layer_stats")
    assert h["stats"] == ["act_rms", "grad_norm"] and h["steps"] == [10]
    rows = ["embedding.weight", "decoder.0.mlp.down.weight", "embedding", "decoder.0"]
    assert h["rows"] == rows and h["values"] == [[0.5, "NaN", None, None]]
    a = live_dashboard.get("/api/runs/layers-1/layer_stats?stat=act_rms")
    assert a["values"] == [[None, None, 0.25, 1.5]]
