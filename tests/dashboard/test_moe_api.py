"""Mixture-of-experts views, dashboard side: `moe_load` messages (tokens per expert per layer)
stored and served as a layer's expert x step grid on SQLite and PostgreSQL, bounded and
malformed input refused with a reason, long runs downsampled; rank stats with the all_to_all
phase and a phase this release does not know; a schema-3 database upgrades in place."""

from __future__ import annotations

import json

import numpy as np
import pytest
import telemetry_data as td
from dashboard_helpers import BACKENDS, JSON_HEADERS, LOCAL
from fastapi.testclient import TestClient
from sqlalchemy import text

from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.db import SCHEMA_VERSION, open_database
from nanotron_dashboard.moe_messages import MAX_MOE_EXPERTS
from nanotron_dashboard.telemetry_messages import LEGACY_RANK_FIELDS


@pytest.fixture(scope="module", params=BACKENDS)
def db(request, tmp_path_factory):
    if request.param == "sqlite":
        return str(tmp_path_factory.mktemp("moe") / "m.db")
    return request.getfixturevalue("pg_server").fresh_database()


@pytest.fixture(scope="module")
def c(db):
    with TestClient(create_app(Settings(db=db)), base_url=LOCAL, headers=JSON_HEADERS) as client:
        yield client


def post(c, msg, status=200):
    r = c.post("/api/ingest", content=json.dumps(msg))
    assert r.status_code == status, r.text
    return r.json()


def moe_load(run_id, step, layers, experts=4):
    """Layer l's expert e gets (e + 1) * (l + 1) + step tokens: every cell tells apart."""
    return {
        "type": "moe_load",
        "run_id": run_id,
        "step": step,
        "layers": [
            {"layer": i, "counts": [(e + 1) * (i + 1) + step for e in range(experts)]}
            for i in layers
        ],
    }


def test_moe_load_stored_and_served_per_layer(c):
    post(c, {"type": "run_start", "run_id": "moe"})
    for step in (5, 10, 15):
        post(c, moe_load("moe", step, [1, 3]))
    post(c, moe_load("moe", 10, [1]) | {"layers": [{"layer": 1, "counts": [9, 0, 0, 7]}]})
    h = c.get("/api/runs/moe/moe_load").json()  # the first layer by default
    assert h["layers"] == [1, 3] and h["layer"] == 1 and h["num_experts"] == 4
    assert h["steps"] == [5, 10, 15] and h["total"] == 3
    assert h["counts"] == [[7, 9, 11, 13], [9, 0, 0, 7], [17, 19, 21, 23]]  # 10: replayed
    assert h["tokens"] == [40, 16, 80]
    h3 = c.get("/api/runs/moe/moe_load?layer=3&from_step=10").json()
    assert h3["layer"] == 3 and h3["steps"] == [10, 15]
    assert h3["counts"][0] == [4 * (e + 1) + 10 for e in range(4)]
    assert c.get("/api/runs/moe/moe_load?layer=2").json()["steps"] == []
    assert c.get("/api/runs/nope/moe_load").status_code == 404
    assert c.get("/api/runs/moe/moe_load?max_steps=0").status_code == 422


def test_long_runs_are_downsampled_to_evenly_spaced_steps(c):
    post(c, {"type": "run_start", "run_id": "long"})
    post(c, [moe_load("long", s, [0], experts=8) for s in range(1, 101)])
    h = c.get("/api/runs/long/moe_load?max_steps=5").json()
    assert h["total"] == 100 and h["steps"] == [1, 26, 51, 75, 100]
    assert h["counts"][-1] == [e + 1 + 100 for e in range(8)]


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"layers": []}, "at least 1"),
        ({"layers": [{"layer": 0, "counts": [1] * (MAX_MOE_EXPERTS + 1)}]}, "at most 1024"),
        ({"layers": [{"layer": 0, "counts": [-1, 2]}]}, "greater than or equal to 0"),
        ({"layers": [{"layer": 0, "counts": [1.5, 2]}]}, "valid integer"),
        ({"layers": [{"layer": 0, "counts": [1]}, {"layer": 0, "counts": [2]}]}, "once"),
        ({"layers": [{"layer": 0, "counts": [1]}, {"layer": 1, "counts": [2, 3]}]}, "same experts"),
        ({"layers": [{"layer": 1 << 16, "counts": [1]}]}, "less than 65536"),
        ({"layers": [{"layer": 0, "counts": [1], "color": "red"}]}, "Extra inputs"),
        ({"step": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_moe_load_is_refused_with_its_reason(c, bad, reason):
    msg = moe_load("bad", 1, [0]) | bad
    r = c.post("/api/ingest", content=json.dumps(msg))
    assert r.status_code == 422 and reason in r.text, r.text


def test_an_oversized_or_malformed_body_is_refused(c):
    huge = moe_load("big", 1, range(300), experts=1000)  # 300k counts: over 1 MiB of JSON
    r = c.post("/api/ingest", content=json.dumps(huge))
    assert r.status_code == 413 or (r.status_code == 422 and "1048576" in r.text), r.text
    assert c.post("/api/ingest", content='{"type": "moe_load", "layers": [').status_code == 400


def test_rank_stats_keep_all_to_all_and_an_unknown_phase_by_name(c):
    post(c, {"type": "run_start", "run_id": "ph"})
    msg = td.rank_stats("ph", 10, n=2)
    for r in msg["ranks"]:
        r["all_to_all_ms"] = 3.0 + r["rank"]
        r["expert_sync_ms"] = 7.5 * (r["rank"] + 1)  # a phase this release does not know
    post(c, msg)
    post(c, td.rank_stats("ph", 20, n=2))  # a later interval without them
    h = c.get("/api/runs/ph/rank_stats?fields=all_to_all_ms,expert_sync_ms,tp_comm_ms").json()
    assert h["values"]["all_to_all_ms"] == [[3.0, 4.0], [None, None]]
    assert h["values"]["expert_sync_ms"] == [[7.5, 15.0], [None, None]]
    assert h["values"]["tp_comm_ms"] == [[10.0, 11.0], [10.0, 11.0]]
    assert "all_to_all_ms" in h["available"] and "expert_sync_ms" not in h["available"]
    assert "expert_sync_ms" in c.get("/api/runs/ph/rank_stats?to_step=10").json()["available"]
    bad = td.rank_stats("ph", 30, n=2)
    bad["ranks"][0]["Bad Name"] = 1.0
    assert "a phase is named like" in json.dumps(post(c, bad, 422))
    bad["ranks"][0] = {k: v for k, v in bad["ranks"][0].items() if k != "Bad Name"}
    bad["ranks"][0] |= {f"p{i}_ms": 1.0 for i in range(9)}
    assert "over the limit of 8" in json.dumps(post(c, bad, 422))
    assert c.get("/api/runs/ph/rank_stats?fields=nope").status_code in (400, 422)


def test_a_schema_3_database_upgrades_and_reads_its_old_rank_stats(tmp_path, request):
    db = str(tmp_path / "old.db")
    with TestClient(create_app(Settings(db=db)), base_url=LOCAL, headers=JSON_HEADERS) as s:
        post(s, {"type": "run_start", "run_id": "old"})
        post(s, td.rank_stats("old", 10, n=2))
    engine = open_database(db)  # as the previous release wrote it: 12 packed fields, no names
    with engine.begin() as conn:
        old = np.array([[float(i + 10 * r) for i in range(12)] for r in range(2)], "<f8")
        conn.execute(text("UPDATE rank_stats SET vals=:v"), {"v": old.tobytes()})
        conn.execute(text("ALTER TABLE rank_stats DROP COLUMN fields"))
        conn.execute(text("DROP TABLE moe_load"))
        conn.execute(text("UPDATE meta SET value='3' WHERE key='schema_version'"))
    engine.dispose()
    with TestClient(create_app(Settings(db=db)), base_url=LOCAL, headers=JSON_HEADERS) as s:
        h = s.get("/api/runs/old/rank_stats").json()
        for j, f in enumerate(LEGACY_RANK_FIELDS):
            assert h["values"][f] == [[float(j), float(j + 10)]], f
        assert h["values"]["all_to_all_ms"] == [[None, None]]
        post(s, moe_load("old", 10, [0]))
        assert s.get("/api/runs/old/moe_load").json()["counts"] == [[11, 12, 13, 14]]
    assert SCHEMA_VERSION == 5


def test_the_queue_cost_of_a_moe_load_covers_its_parsed_memory():
    import tracemalloc

    from nanotron_dashboard import ingest
    from nanotron_dashboard.messages import parse_messages

    for layers, experts in ((48, 128), (2, 1024), (1, 1)):
        raw = json.dumps(moe_load("mem", 7, range(layers), experts=experts) | {"time": 1.0})
        tracemalloc.start()
        parsed = parse_messages(raw)
        used, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert ingest._cost(len(raw), 1, parsed[0]) >= used, (layers, experts, used)
