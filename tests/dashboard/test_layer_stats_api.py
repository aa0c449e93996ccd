"""Per-layer statistics, dashboard side: `layer_stats` messages (one value per layer and
statistic at a detail step) stored and served as a statistic's rows x steps grid on SQLite and
PostgreSQL; non-finite values kept, a replay overwrites, malformed input refused with a reason,
long runs downsampled."""

from __future__ import annotations

import json

import pytest
from dashboard_helpers import BACKENDS, JSON_HEADERS, LOCAL
from fastapi.testclient import TestClient

from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.layer_messages import MAX_LAYER_ROWS

ROWS = ["embedding.weight", "decoder.0.attn.qkv.weight", "decoder.0"]


@pytest.fixture(scope="module", params=BACKENDS)
def c(request, tmp_path_factory):
    if request.param == "sqlite":
        db = str(tmp_path_factory.mktemp("layers") / "l.db")
    else:
        db = request.getfixturevalue("pg_server").fresh_database()
    with TestClient(create_app(Settings(db=db)), base_url=LOCAL, headers=JSON_HEADERS) as client:
        yield client


def post(c, msg, status=200):
    r = c.post("/api/ingest", content=json.dumps(msg))
    assert r.status_code == status, r.text
    return r.json()


def layer_stats(run_id, step, rows=ROWS):
    """Row i's grad norm is step + i / 10, its weight norm 10 x that: every cell tells apart."""
    grad = [step + i / 10 for i in range(len(rows))]
    return {"type": "layer_stats", "run_id": run_id, "step": step, "rows": rows,
            "stats": {"grad_norm": grad, "weight_norm": [10 * g for g in grad]}}  # fmt: skip


def test_layer_stats_stored_and_served_per_statistic(c):
    post(c, {"type": "run_start", "run_id": "ls"})
    for step in (10, 20, 30):
        post(c, layer_stats("ls", step))
    replay = layer_stats("ls", 20)
    replay["stats"]["grad_norm"] = ["nan", "inf", None]  # a replay overwrites
    post(c, replay)
    h = c.get("/api/runs/ls/layer_stats").json()  # grad_norm by default
    assert h["stats"] == ["grad_norm", "weight_norm"] and h["stat"] == "grad_norm"
    assert h["rows"] == ROWS and h["steps"] == [10, 20, 30] and h["total"] == 3
    assert h["values"] == [[10.0, 10.1, 10.2], ["NaN", "Infinity", None], [30.0, 30.1, 30.2]]
    w = c.get("/api/runs/ls/layer_stats?stat=weight_norm&from_step=20").json()
    assert w["steps"] == [20, 30] and w["values"][1] == [300.0, 301.0, 302.0]
    # a step with other rows: the union, each step's values in its place
    post(c, layer_stats("ls", 40, ["decoder.0", "decoder.1"]))
    h = c.get("/api/runs/ls/layer_stats?from_step=30").json()
    assert h["rows"] == [*ROWS, "decoder.1"]
    assert h["values"] == [[30.0, 30.1, 30.2, None], [None, None, 40.0, 40.1]]
    assert c.get("/api/runs/ls/layer_stats?stat=act_rms").json()["steps"] == []
    assert c.get("/api/runs/nope/layer_stats").status_code == 404
    assert c.get("/api/runs/ls/layer_stats?max_steps=0").status_code == 422


def test_long_runs_are_downsampled_to_evenly_spaced_steps(c):
    post(c, {"type": "run_start", "run_id": "ls-long"})
    post(c, [layer_stats("ls-long", s) for s in range(1, 101)])
    h = c.get("/api/runs/ls-long/layer_stats?max_steps=5").json()
    assert h["total"] == 100 and h["steps"] == [1, 26, 51, 75, 100]
    assert h["values"][-1] == [100.0, 100.1, 100.2]


@pytest.mark.parametrize(
    "change, says",
    [
        ({"rows": ["a", "a"], "stats": {"grad_norm": [1.0, 2.0]}}, "each row must appear once"),
        ({"stats": {"grad_norm": [1.0]}}, "1 values for 3 rows"),
        ({"rows": [f"r{i}" for i in range(MAX_LAYER_ROWS + 1)]}, "at most 4096"),
        ({"stats": {"bad name!": [1.0, 2.0, 3.0]}}, "stats.bad name!"),
        ({"stats": {f"s{i}": [1.0, 2.0, 3.0] for i in range(17)}}, "at most 16"),
    ],
)
def test_malformed_layer_stats_are_refused_with_a_reason(c, change, says):
    r = c.post("/api/ingest", content=json.dumps({**layer_stats("ls-bad", 1), **change}))
    assert r.status_code == 422 and says in r.text, r.text
