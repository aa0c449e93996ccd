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


# The layers that moved first (layer_departures.py). grad_norm per step; row -> values at
# steps 10..80. Step 10 is outside the window read (poison), 80 after the alert at 75.
MOVED = {
    "embedding.weight": [1000.0, 1.0, 1.1, 0.9, 1.0, 1.05, 1.5, 1.0],
    "decoder.0.attn.qkv.weight": [2.0, 2.0, 2.0, 2.0, 2.0, 2.1, 2.0, 2.0],
    "decoder.0": [3.0, 3.0, 3.3, 2.7, 3.0, 3.1, "nan", 3.0],
    "final_norm": [1.0, 1.0, 1.0, 1.0, 1.0, 1.001, 1.02, 1.0],
    "decoder.1": [None, None, None, None, None, 5.0, 5.0, 5.0],  # no baseline
}


def test_layers_that_moved_first_ranked_by_departure_from_their_baseline(c):
    post(c, {"type": "run_start", "run_id": "lm"})
    for j, step in enumerate(range(10, 90, 10)):
        rows = [r for r, v in MOVED.items() if v[j] is not None]
        grad = [MOVED[r][j] for r in rows]
        post(c, {"type": "layer_stats", "run_id": "lm", "step": step, "rows": rows,
                 "stats": {"grad_norm": grad, "weight_norm": [1.0] * len(rows)}})  # fmt: skip
    q = "/api/runs/lm/layer_stats/moved_first?step=75&lead=2&baseline=4"
    m = c.get(q).json()
    assert m["stat"] == "grad_norm" and m["threshold"] == 3.0
    assert m["baseline_steps"] == [20, 30, 40, 50] and m["lead_steps"] == [60, 70]
    assert (m["from_step"], m["to_step"]) == (20, 80)  # the heatmap's window around step 75
    got = {r["row"]: r for r in m["ranked"]}
    order = ["decoder.0.attn.qkv.weight", "decoder.0", "embedding.weight", "final_norm"]
    assert [r["row"] for r in m["ranked"]] == [*order, "decoder.1"]
    # median 2, MAD 0: the spread is its floor, 1% of 2; 2.1 at step 60 is 5 spreads away
    qkv = got["decoder.0.attn.qkv.weight"]
    assert (qkv["first_step"], qkv["value"], qkv["median"]) == (60, 2.1, 2.0)
    assert qkv["departure"] == pytest.approx(5.0)
    # median 1.0, MAD 0.05 -> spread 1.4826 * 0.05; 1.5 at step 70 (1000 at step 10 unread)
    emb = got["embedding.weight"]
    assert (emb["first_step"], emb["value"], emb["median"]) == (70, 1.5, 1.0)
    assert emb["departure"] == pytest.approx(0.5 / (1.4826 * 0.05))
    dec = got["decoder.0"]  # NaN at step 70: an infinite departure, ranked before 6.7
    assert (dec["first_step"], dec["departure"], dec["value"]) == (70, "Infinity", "NaN")
    fin = got["final_norm"]  # 2 spreads at most: not departed, ranked by its largest
    assert fin["first_step"] is None and fin["departure"] == pytest.approx(2.0)
    assert got["decoder.1"] == {"row": "decoder.1", "first_step": None, "departure": None,
                                "value": None, "median": None}  # fmt: skip
    # a looser threshold: final_norm departs at step 70 too, after decoder.0 (larger)
    loose = c.get(q + "&threshold=1.5").json()["ranked"]
    assert [r["row"] for r in loose][:4] == ["decoder.0.attn.qkv.weight", "decoder.0",
                                             "embedding.weight", "final_norm"]  # fmt: skip
    assert loose[3]["first_step"] == 70
    w = c.get("/api/runs/lm/layer_stats/moved_first?step=75&stat=weight_norm").json()
    assert w["stat"] == "weight_norm" and w["lead_steps"] == [50, 60, 70]  # defaults 3 and 8
    assert w["baseline_steps"] == [10, 20, 30, 40] and w["ranked"][0]["first_step"] is None
    early = c.get("/api/runs/lm/layer_stats/moved_first?step=5").json()
    assert early["ranked"] == [] and early["lead_steps"] == [] and early["from_step"] is None


def test_moved_first_inputs_are_bounded(c):
    post(c, {"type": "run_start", "run_id": "lm-bad"})
    bad = ["step=-1", "step=75&lead=0", "step=75&lead=17", "step=75&baseline=1",
           "step=75&baseline=65", "step=75&threshold=0", "step=75&threshold=inf",
           "step=75&threshold=nan", "step=75&stat=bad!", ""]  # fmt: skip
    for query in bad:
        r = c.get(f"/api/runs/lm-bad/layer_stats/moved_first?{query}")
        assert r.status_code == 422, query
    assert c.get("/api/runs/nope/layer_stats/moved_first?step=1").status_code == 404
