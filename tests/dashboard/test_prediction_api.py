"""The layout planner's prediction on the dashboard: the `prediction` message stored (one per
run, a later attempt's replacing it) and served next to what the run's rank_stats measured,
with the ratio of each part and the parts off by more than 20% flagged; a bad message is
refused naming its field."""

from __future__ import annotations

import json

import pytest
import telemetry_data as td
from dashboard_helpers import BACKENDS, JSON_HEADERS, LOCAL
from fastapi.testclient import TestClient

from nanotron_dashboard.app import Settings, create_app


@pytest.fixture(scope="module", params=BACKENDS)
def c(request, tmp_path_factory):
    if request.param == "sqlite":
        db = str(tmp_path_factory.mktemp("prediction") / "p.db")
    else:
        db = request.getfixturevalue("pg_server").fresh_database()
    with TestClient(create_app(Settings(db=db)), base_url=LOCAL, headers=JSON_HEADERS) as client:
        yield client


def post(c, msg, status=200):
    r = c.post("/api/ingest", content=json.dumps(msg))
    assert r.status_code == status, r.text
    return r.json()


def start(c, run_id):
    return post(c, {"type": "run_start", "run_id": run_id})


PREDICTION = td.PREDICTION


def test_prediction_next_to_what_the_rank_stats_measured(c):
    start(c, "pv")
    assert c.get("/api/runs/pv/prediction").json()["predicted"] is None  # none sent yet
    post(c, PREDICTION)
    for step in range(10, 101, 10):
        post(c, td.rank_stats("pv", step, n=4, slow=3))
    body = c.get("/api/runs/pv/prediction").json()
    assert body["predicted"]["step_ms"] == 300.0 and body["predicted"]["device"] == "h100"
    m = body["measured"]
    # steps 20..100 (10 is start-up): each phase's mean over the 4 ranks, median over steps
    # (step 60's); compute (100, 101, 102, 2 x 103) + step/1000 each
    assert m["intervals"] == 9 and m["step_ms"] == 460.0
    assert m["compute_ms"] == pytest.approx((509 + 5 * 0.06) / 4)
    assert m["comm_ms"] == pytest.approx(11.5 + 300 - (509 + 5 * 0.06) / 4)  # tp + dp wait
    assert m["idle_ms"] == 0.0 and m["optimizer_ms"] == 20.0 and m["memory_bytes"] == 4_000_000
    cmp = body["compare"]
    assert cmp["memory_bytes"] == {"ratio": pytest.approx(0.975), "off": False}
    assert cmp["step_ms"] == {"ratio": pytest.approx(300 / 460), "off": True}
    assert cmp["compute_ms"]["off"] is False and cmp["optimizer_ms"]["ratio"] == 1.05
    assert cmp["comm_ms"]["off"] is True
    assert cmp["idle_ms"] == {"ratio": None, "off": False, "negligible": True}
    post(c, {**PREDICTION, "step_ms": 470.0})  # a later attempt's replaces it
    assert c.get("/api/runs/pv/prediction").json()["compare"]["step_ms"]["off"] is False


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"step_ms": -1.0}, "step_ms"),
        ({"memory_bytes": "many"}, "memory_bytes"),
        ({"device": "x" * 201}, "device"),
        ({"layout": "dp=2"}, "layout"),
        ({"compute_ms": None}, "compute_ms"),
    ],
)
def test_a_bad_prediction_is_refused_with_its_field(c, change, reason):
    start(c, "pv-bad")
    r = c.post("/api/ingest", content=json.dumps({**PREDICTION, "run_id": "pv-bad", **change}))
    assert r.status_code == 422 and reason in r.text, r.text
    assert c.get("/api/runs/pv-bad/prediction").json()["predicted"] is None


def test_finite_numbers_whose_sum_or_ratio_overflows_give_no_ratio_not_a_500(c):
    """Every stored number is finite, but a part's sum (tp + dp wait) or a ratio (a huge
    prediction over a tiny measurement) can pass the largest float: no number, never a 500."""
    start(c, "pv-huge")
    post(c, {**PREDICTION, "run_id": "pv-huge", "optimizer_ms": 1e300})
    for step in (10, 20, 30):
        msg = td.rank_stats("pv-huge", step, n=4)
        for r in msg["ranks"]:
            r.update(tp_comm_ms=1.7e308, dp_wait_ms=1.7e308, optimizer_ms=1e-300)
        post(c, msg)
    r = c.get("/api/runs/pv-huge/prediction")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["measured"]["comm_ms"] is None and body["measured"]["optimizer_ms"] == 1e-300
    assert body["compare"]["comm_ms"] == {"ratio": None, "off": False}
    assert body["compare"]["optimizer_ms"] == {"ratio": None, "off": True}
