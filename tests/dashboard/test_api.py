"""REST and ingest through FastAPI's TestClient (no socket)."""

from __future__ import annotations

import csv
import io
import json
import math
import shlex
import time

import numpy as np
import pytest
from dashboard_helpers import JSON_HEADERS, LOCAL, WS
from fastapi.testclient import TestClient

from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.checkpoints import resume_argv, resume_command
from nanotron_dashboard.series import downsample, ema

CMD = ["torchrun", "--nproc_per_node=2", "-m", "nanotron_train", "--config-file", "tiny.yaml"]


@pytest.fixture()
def client(db_url):
    """This module's API and ingest tests run on SQLite and on PostgreSQL."""
    app = create_app(Settings(db=db_url, stall_seconds=60))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as c:
        yield c


def start(c, run_id="r1", **kw):
    msg = {
        "type": "run_start",
        "run_id": run_id,
        "project": "p",
        "name": run_id,
        "config": {"a": 1},
        "world_size": 2,
        "topology": {"dp": 2, "tp": 1, "pp": 1},
        "command": CMD,
        "cwd": "/work dir",
    }
    msg.update(kw)
    r = c.post("/api/ingest", json=msg)
    assert r.status_code == 200, r.text
    return r.json()


def points(c, run_id, steps, fn):
    msgs = [{"type": "metrics", "run_id": run_id, "step": s, "values": fn(s)} for s in steps]
    for i in range(0, len(msgs), 2000):  # under the 1 MiB message limit
        r = c.post("/api/ingest", content=json.dumps(msgs[i : i + 2000]))
        assert r.status_code == 200, r.text
        assert r.json()["accepted"] == len(msgs[i : i + 2000])


def test_run_list_filters_and_last_values(client):
    start(client, "a", project="p1")
    start(client, "b", project="p2", name="other")
    points(client, "a", range(1, 11), lambda s: {"lm_loss": 10.0 / s, "tokens_per_sec": 100.0 * s})
    client.post(
        "/api/ingest", json={"type": "run_end", "run_id": "b", "status": "failed", "error": "<oom>"}
    )
    runs = {r["id"]: r for r in client.get("/api/runs").json()}
    assert runs["a"]["step"] == 10 and runs["a"]["last"] == {
        "lm_loss": 1.0,
        "tokens_per_sec": 1000.0,
    }
    assert runs["a"]["status"] == "running" and runs["b"]["status"] == "failed"
    assert [r["id"] for r in client.get("/api/runs?project=p1").json()] == ["a"]
    assert [r["id"] for r in client.get("/api/runs?status=failed").json()] == ["b"]
    assert [r["id"] for r in client.get("/api/runs?name=oth").json()] == ["b"]
    assert [r["id"] for r in client.get("/api/runs?name=OTH").json()] == ["b"]  # either case
    run = client.get("/api/runs/b").json()
    assert run["error"] == "<oom>" and run["config"] == {"a": 1} and run["command"] == CMD
    assert client.get("/api/runs/nope").status_code == 404


def test_replayed_points_do_not_duplicate(client):
    start(client)
    points(client, "r1", range(5), lambda s: {"lm_loss": float(s)})
    points(client, "r1", range(5), lambda s: {"lm_loss": float(s)})
    s = client.get("/api/runs/r1/metrics?names=lm_loss").json()["series"]["lm_loss"]
    assert s["count"] == 5 and s["y"] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_nan_and_inf_are_stored_and_returned(client):
    start(client)
    client.post(
        "/api/ingest",
        content='{"type":"metrics","run_id":"r1","step":1,"values":{"lm_loss":NaN,"grad_norm":Infinity}}',
    )
    client.post(
        "/api/ingest",
        json={
            "type": "metrics",
            "run_id": "r1",
            "step": 2,
            "values": {"lm_loss": "-inf", "grad_norm": 1.5},
        },
    )
    series = client.get("/api/runs/r1/metrics").json()["series"]
    assert [p["value"] for p in series["lm_loss"]["nonfinite"]] == ["NaN", "-Infinity"]
    assert series["grad_norm"]["nonfinite"] == [{"x": 1.0, "step": 1, "value": "Infinity"}]
    assert series["grad_norm"]["y"] == [None, 1.5]
    assert client.get("/api/runs").json()[0]["last"]["lm_loss"] == "-Infinity"
    rows = list(csv.reader(io.StringIO(client.get("/api/runs/r1/metrics.csv").text)))
    assert rows == [["step", "grad_norm", "lm_loss"], ["1", "inf", "nan"], ["2", "1.5", "-inf"]]


def test_invalid_messages_are_rejected_with_a_reason(client):
    start(client)
    r = client.post(
        "/api/ingest",
        json=[
            {"type": "metrics", "run_id": "r1", "step": -1, "values": {"x": 1}},
            {"type": "bogus", "run_id": "r1"},
            {"type": "metrics", "run_id": "r1", "step": 3, "values": {"x": 1}},
        ],
    )
    assert r.status_code == 422
    body = r.json()
    assert body["accepted"] == 1 and [e["index"] for e in body["errors"]] == [0, 1]
    assert "greater than or equal to 0" in body["errors"][0]["error"]
    assert client.post("/api/ingest", content=b"{not json").status_code == 400
    big = json.dumps({"type": "heartbeat", "run_id": "r1", "pad": "x" * (2 << 20)})
    assert client.post("/api/ingest", content=big).status_code == 413
    with client.websocket_connect(WS + "/ws/ingest") as ws:
        ws.send_text("nope")
        assert ws.receive_json()["ok"] is False
        ws.send_text(big)
        assert "exceeds" in ws.receive_json()["error"]
        ws.send_json({"type": "metrics", "run_id": "r1", "step": 4, "values": {}})
        assert "at least one metric" in ws.receive_json()["error"]
        ws.send_json(
            {"type": "run_start", "run_id": "r1", "command": CMD, "cwd": "/work dir"}
        )  # still alive (the same run_start again: a trainer's reconnect)
        assert ws.receive_json() == {
            "ok": True,
            "type": "run_start",
            "run_id": "r1",
            "last_step": 3,
        }


def test_downsampling_keeps_extremes_first_and_last(client):
    start(client)
    n = 10_000
    rng = np.random.default_rng(0)
    ys = rng.normal(size=n)
    ys[1234], ys[8765] = 50.0, -50.0
    points(
        client, "r1", range(n), lambda s: {"lm_loss": float(ys[s]), "consumed_tokens": 64 * (s + 1)}
    )
    s = client.get("/api/runs/r1/metrics?names=lm_loss&max_points=400").json()["series"]["lm_loss"]
    assert s["count"] == n and len(s["x"]) <= 400
    assert s["step"][0] == 0 and s["step"][-1] == n - 1
    assert 50.0 in s["y"] and -50.0 in s["y"] and s["step"][s["y"].index(50.0)] == 1234
    t = client.get("/api/runs/r1/metrics?names=lm_loss&max_points=400&x=tokens").json()["series"][
        "lm_loss"
    ]
    assert t["x"][0] == 64 and t["x"][-1] == 64 * n
    tm = client.get("/api/runs/r1/metrics?names=lm_loss&x=time&max_points=10").json()["series"][
        "lm_loss"
    ]
    assert all(0 <= x < 60 for x in tm["x"])


def test_smoothing_does_not_depend_on_points_drawn(tmp_path):
    """SQLite only: the smoothing is numpy's on a loaded series, read as the downsampling
    test reads it on both backends."""
    app = create_app(Settings(db=str(tmp_path / "runs.db"), stall_seconds=60))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as client:
        smoothing_does_not_depend_on_points_drawn(client)


def smoothing_does_not_depend_on_points_drawn(client):
    start(client)
    ys = [math.sin(s / 50) + (s % 7) * 0.1 for s in range(3000)]
    points(client, "r1", range(3000), lambda s: {"lm_loss": ys[s]})
    a = client.get("/api/runs/r1/metrics?names=lm_loss&max_points=100&smoothing=0.9").json()[
        "series"
    ]["lm_loss"]
    b = client.get("/api/runs/r1/metrics?names=lm_loss&max_points=5000&smoothing=0.9").json()[
        "series"
    ]["lm_loss"]
    full = dict(zip(b["step"], b["smooth"]))
    assert len(b["step"]) == 3000
    for step, v in zip(a["step"], a["smooth"]):
        assert v == pytest.approx(full[step], abs=1e-12)
    acc = 0.0  # reference: TensorBoard's debiased EMA
    for y in ys[:100]:
        acc = 0.9 * acc + 0.1 * y
    assert full[99] == pytest.approx(acc / (1 - 0.9**100), rel=1e-12)


def test_csv_is_full_fidelity(client):
    start(client)
    vals = [1 / 3, 2.0**-40, 123456789.123456789]
    points(client, "r1", range(3), lambda s: {"lm_loss": vals[s]})
    rows = list(csv.reader(io.StringIO(client.get("/api/runs/r1/metrics.csv").text)))
    assert [float(r[1]) for r in rows[1:]] == vals


def test_checkpoints_from_messages_and_disk(client, tmp_path):
    ck_root = tmp_path / "ck dir"
    start(
        client, checkpoints_path=str(ck_root), cwd=str(tmp_path), command=[*CMD, "--resume", "old"]
    )
    client.post(
        "/api/ingest",
        json={
            "type": "checkpoint",
            "run_id": "r1",
            "step": 10,
            "path": str(ck_root / "10"),
            "consumed_tokens": 640,
        },
    )
    for step, good in ((20, True), (30, False)):  # written while the dashboard was down
        d = ck_root / str(step)
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 100)
        meta = {
            "step": step,
            "consumed_samples": step * 2,
            "consumed_tokens": step * 64,
            "topology": {"dp": 2, "tp": 1, "pp": 1},
            "format_version": 1,
            "created": time.time(),
            "files": [{"path": "model.safetensors", "size": 100 if good else 999, "sha256": "0"}],
        }
        (d / "checkpoint_metadata.json").write_text(json.dumps(meta))
    (ck_root / "40").mkdir()  # no metadata yet: an unfinished save is not listed
    cks = client.get("/api/runs/r1/checkpoints").json()
    assert [(c["step"], c["complete"], c["consumed_tokens"]) for c in cks] == [
        (10, True, 640),
        (20, True, 1280),
        (30, False, 1920),
    ]
    assert cks[1]["size"] == 100 and cks[1]["topology"] == {"dp": 2, "tp": 1, "pp": 1}
    # 30 follows 20 in the folder: resuming 20 saves into a sibling folder (the trainer never
    # writes over a newer checkpoint); the newest resumes in place.
    branch = f"checkpoints.checkpoints_path={tmp_path / 'ck dir-from-20'}"
    expected = shlex.join([*CMD, "--resume", str(ck_root / "20"), "--override", branch])
    assert cks[1]["resume_command"] == expected
    assert cks[2]["resume_command"] == shlex.join([*CMD, "--resume", str(ck_root / "30")])
    assert cks[1]["resume_shell"] == f"cd {shlex.quote(str(tmp_path))} && {expected}"
    # a run started with --resume on a listed checkpoint links to its parent
    start(client, "r2", command=[*CMD, "--resume", str(ck_root / "20")])
    assert client.get("/api/runs/r2").json()["resumed_from"] == {"run_id": "r1", "step": 20}
    assert client.get("/api/runs/r1").json()["resumed_runs"] == ["r2"]


def test_config_diff(client):
    start(client, "a", config={"optimizer": {"lr": 1e-3, "wd": 0.1}, "seed": 1})
    start(client, "b", config={"optimizer": {"lr": 3e-4, "wd": 0.1}, "extra": True, "seed": 1})
    d = client.get("/api/diff?a=a&b=b").json()["differences"]
    assert d == [
        {"key": "extra", "a": None, "b": True, "only_in": "b"},
        {"key": "optimizer.lr", "a": 1e-3, "b": 3e-4, "only_in": None},
    ]


def test_stalled_by_heartbeat_age(tmp_path):
    app = create_app(Settings(db=str(tmp_path / "s.db"), stall_seconds=0.3))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as c:
        start(c)
        assert c.get("/api/runs/r1").json()["status"] == "running"
        time.sleep(0.5)
        assert c.get("/api/runs/r1").json()["status"] == "stalled"
        assert [r["id"] for r in c.get("/api/runs?status=stalled").json()] == ["r1"]
        c.post("/api/ingest", json={"type": "heartbeat", "run_id": "r1"})
        assert c.get("/api/runs/r1").json()["status"] == "running"


def test_openapi_and_pages(client):
    assert "/api/runs/{run_id}/metrics" in client.get("/openapi.json").json()["paths"]
    assert client.get("/docs").status_code == 200
    assert "uPlot.iife.min.js" in client.get("/runs/x").text
    assert client.get("/static/vendor/uPlot.iife.min.js").status_code == 200


def test_resume_argv_replaces_earlier_resume():
    assert resume_argv(["a", "--resume", "x", "b", "--resume=y"], "/c k", None) == [
        "a",
        "b",
        "--resume",
        "/c k",
    ]
    assert resume_command(["python", "-m", "t"], "/c k/1", 1) == "python -m t --resume '/c k/1'"


def test_downsample_and_ema_units():
    x = np.arange(100.0)
    y = np.sin(x)
    assert downsample(x, y, 1000).tolist() == list(range(100))
    idx = downsample(x, y, 20)
    assert len(idx) <= 20 and idx[0] == 0 and idx[-1] == 99 and np.argmax(y) in idx
    s = ema(np.array([1.0, np.nan, 3.0]), 0.5)
    assert s.tolist() == pytest.approx([1.0, 1.0, (0.25 * 1 + 0.125 * 1 + 0.5 * 3) / 0.875])


def test_restarted_launches_are_attempts_of_one_run_and_preempted_is_a_status(client):
    start(client, "r1", attempt="launch-a", time=100.0)
    start(client, "r1", attempt="launch-a", time=100.0)  # a replay of the same launch
    end = {"type": "run_end", "run_id": "r1", "status": "preempted"}
    assert client.post("/api/ingest", json=end).status_code == 200
    assert client.get("/api/runs/r1").json()["status"] == "preempted"
    assert [r["id"] for r in client.get("/api/runs?status=preempted").json()] == ["r1"]
    start(client, "r1", attempt="launch-b", time=200.0)  # torchrun restart / --resume auto
    run = client.get("/api/runs/r1").json()
    assert run["status"] == "running" and run["attempts"] == [100.0, 200.0]
    assert len(client.get("/api/runs").json()) == 1
    bad = client.post("/api/ingest", json={**end, "status": "paused"})
    assert bad.json()["accepted"] == 0 and "'preempted'" in bad.json()["errors"][0]["error"]


def test_metrics_response_is_bounded_across_names(client, monkeypatch):
    """max_points is per series: many names share one bound on the points returned (here
    shrunk to 1,000 so a small run shows it; the server's is api.METRIC_POINTS)."""
    from nanotron_dashboard import api

    monkeypatch.setattr(api, "METRIC_POINTS", 1000)
    start(client)
    names = [f"m{i}" for i in range(10)]
    points(client, "r1", range(500), lambda s: {n: float(s) for n in names})
    every = client.get("/api/runs/r1/metrics?max_points=50000").json()["series"]
    assert sorted(every) == sorted(names)
    assert all(s["count"] == 500 and 8 <= len(s["x"]) <= 100 for s in every.values())
    assert sum(len(s["x"]) for s in every.values()) <= 1000
    one = client.get("/api/runs/r1/metrics?names=m3&max_points=50000").json()["series"]["m3"]
    assert len(one["x"]) == 500 and one["y"] == [float(s) for s in range(500)]
