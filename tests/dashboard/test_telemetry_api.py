"""Telemetry, dashboard side: the telemetry messages (rank_stats, pipeline_timeline, event,
samples) stored and served with their values, bad input refused with a reason, replays
idempotent, restart and stall events derived, tags and a note (CSRF), live notices."""

from __future__ import annotations

import json
import sqlite3
import time
import tracemalloc

import pytest
import telemetry_data as td
from dashboard_helpers import BACKENDS, JSON_HEADERS, LOCAL, WS
from fastapi.testclient import TestClient

from nanotron_dashboard import ingest
from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.messages import parse_messages
from nanotron_dashboard.telemetry_messages import RANK_FIELDS
from nanotron_dashboard.telemetry_store import StallCheck


@pytest.fixture(scope="module", params=BACKENDS)
def c(request, tmp_path_factory):
    """One app per backend: this module's API and websocket tests run on SQLite and PostgreSQL."""
    if request.param == "sqlite":
        db = str(tmp_path_factory.mktemp("telemetry") / "t.db")
    else:
        db = request.getfixturevalue("pg_server").fresh_database()
    app = create_app(Settings(db=db))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as client:
        client.csrf = client.get("/api/session").json()["csrf"]  # type: ignore[attr-defined]
        yield client


def post(c, msg, status=200):
    r = c.post("/api/ingest", content=json.dumps(msg))
    assert r.status_code == status, r.text
    return r.json()


def start(c, run_id, **kw):
    return post(c, {"type": "run_start", "run_id": run_id, **kw})


def test_rank_stats_served_as_a_heatmap_grid(c):
    start(c, "rs")
    for step in (10, 20, 30):
        post(c, td.rank_stats("rs", step, n=4, slow=3))
    h = c.get("/api/runs/rs/rank_stats").json()
    assert h["steps"] == [10, 20, 30] and h["total"] == 3 and h["intervals"] == [10, 10, 10]
    assert h["fields"] == list(RANK_FIELDS)
    assert h["ranks"] == [
        {"rank": r, "dp": r // 2, "tp": r % 2, "pp": 0, "cp": 0, "host": td.HOSTS[r // 2]}
        for r in range(4)
    ]
    # values[field][interval][rank], exactly as sent; null stays null
    assert h["values"]["compute_ms"][1] == [100.02, 101.02, 102.02, 103.02 * 2]
    assert h["values"]["step_ms"][2] == [430.0] * 4
    assert h["values"]["mem_reserved_bytes"][0] == [None] * 4
    assert h["values"]["mem_bytes"][0] == [1e6, 2e6, 3e6, 4e6]
    # a replay of an interval overwrites it (no second column)
    post(c, td.rank_stats("rs", 20, n=4, slow=None))
    h = c.get("/api/runs/rs/rank_stats?fields=compute_ms&from_step=15&to_step=25").json()
    assert h["steps"] == [20] and list(h["values"]) == ["compute_ms"]
    assert h["values"]["compute_ms"] == [[100.02, 101.02, 102.02, 103.02]]
    # at most max_steps intervals, evenly spaced, always the newest
    for step in range(40, 210, 10):
        post(c, td.rank_stats("rs", step, n=4))
    h = c.get("/api/runs/rs/rank_stats?max_steps=3&fields=step_ms").json()
    assert h["total"] == 20 and h["steps"] == [10, 110, 200]
    # a rank missing from an older interval is null there (rows: the newest interval's ranks)
    post(c, td.rank_stats("rs", 300, n=6))
    h = c.get("/api/runs/rs/rank_stats?from_step=200&fields=cpu_util_pct").json()
    assert [r["rank"] for r in h["ranks"]] == list(range(6))
    assert h["values"]["cpu_util_pct"] == [
        [50.0, 51.0, 52.0, 53.0, None, None],
        [50.0 + r for r in range(6)],
    ]
    # a large world arrives as several messages per step (disjoint ranks): merged
    whole = td.rank_stats("rs", 310, n=6, slow=5)
    post(c, {**whole, "ranks": whole["ranks"][3:]})
    post(c, {**whole, "ranks": whole["ranks"][:3]})
    post(c, {**whole, "ranks": [{**whole["ranks"][4], "compute_ms": 1.5}]})  # one rank again
    h = c.get("/api/runs/rs/rank_stats?from_step=310&fields=compute_ms").json()
    assert [r["host"] for r in h["ranks"]] == ["node-a"] * 3 + ["node-b"] * 3
    assert h["values"]["compute_ms"] == [[100.31, 101.31, 102.31, 103.31, 1.5, 105.31 * 2]]
    r = c.get("/api/runs/rs/rank_stats?fields=bogus")
    assert r.status_code == 400 and "bogus" in r.json()["detail"]
    assert c.get("/api/runs/nope/rank_stats").status_code == 404
    assert c.get("/api/runs/rs/rank_stats?max_steps=0").status_code == 422


def test_pipeline_timeline_list_and_spans(c):
    start(c, "tl")
    post(c, td.timeline("tl", 100, pp=2, m=4))
    post(c, td.timeline("tl", 200, pp=4, m=8))
    listed = c.get("/api/runs/tl/timelines").json()
    assert [(t["step"], t["pp"], t["micro_batches"], t["spans"]) for t in listed] == [
        (100, 2, 4, 16),
        (200, 4, 8, 64),
    ]
    assert listed[1]["bubble_formula"] == pytest.approx(3 / 11)
    assert listed[1]["bubble_measured"] == pytest.approx(3 / 11)
    one = c.get("/api/runs/tl/timelines/100").json()
    assert one["spans"] == td.one_f_one_b(2, 4) and one["schedule"] == "1f1b"
    assert one["bubble_measured"] == pytest.approx(0.2)
    assert one["clock"] == {"order_violations": 0, "offsets_ms": [], "uncertainty_ms": []}
    clock = {"order_violations": 3, "offsets_ms": [0.0, -1.5], "uncertainty_ms": [0.0, 0.25]}
    post(c, {**td.timeline("tl", 300), "bubble_measured": None, "clock": clock})
    got = c.get("/api/runs/tl/timelines/300").json()
    assert got["clock"] == clock and got["bubble_measured"] is None
    assert c.get("/api/runs/tl/timelines/150").status_code == 404
    post(c, {**td.timeline("tl", 100, pp=2, m=2)})  # a replay replaces the step
    assert c.get("/api/runs/tl/timelines/100").json()["micro_batches"] == 2
    assert len(c.get("/api/runs/tl/timelines").json()) == 3


def test_a_new_span_kind_is_stored_and_served_and_old_coded_rows_still_read(c):
    start(c, "zb")
    msg = {**td.timeline("zb", 10), "schedule": "zb-h1"}
    msg["spans"] = td.with_weight_grad(msg["spans"])
    post(c, msg)
    one = c.get("/api/runs/zb/timelines/10").json()
    assert one["spans"] == msg["spans"] and one["schedule"] == "zb-h1"
    kinds = [s["kind"] for s in one["spans"]]
    assert (kinds.count("forward"), kinds.count("backward"), kinds.count("W")) == (8, 8, 8)
    # a timeline stored before spans carried their kind's name: codes 0 and 1
    old = [[0, 0, 0, 0, 0.0, 10.0], [0, 0, 0, 1, 10.0, 30.0]]
    c.app.state.writer.submit(
        lambda conn: conn.exec_driver_sql(
            "INSERT INTO timelines(run_pk, step, time, schedule, pp, chunks, micro_batches, "
            "n_spans, spans) SELECT pk, 5, 0, '1f1b', 1, 1, 1, 2, ? FROM runs WHERE id='zb'",
            (json.dumps(old),),
        ),
        want_result=True,
    ).result(10)
    spans = c.get("/api/runs/zb/timelines/5").json()["spans"]
    assert [(s["kind"], s["start_ms"], s["end_ms"]) for s in spans] == [
        ("forward", 0.0, 10.0),
        ("backward", 10.0, 30.0),
    ]


def test_events_idempotent_listed_and_counted_in_the_run_list(c):
    start(c, "ev")
    post(c, td.straggler("ev", 57))
    post(c, td.straggler("ev", 57))  # a replay
    post(c, td.event("ev", "nonfinite_loss", 60, severity="critical", message="loss is nan"))
    post(c, td.event("ev", "loss_spike", None, message="<b>spike</b>"))
    post(c, td.event("ev", "loss_spike", None, message="<b>spike</b>"))  # null step replayed
    post(c, td.event("ev", "loss_spike", 61, severity="info"))
    evs = c.get("/api/runs/ev/events").json()
    assert [(e["kind"], e["step"], e["severity"], e["source"]) for e in evs] == [
        ("straggler", 57, "warning", "trainer"),
        ("nonfinite_loss", 60, "critical", "trainer"),
        ("loss_spike", None, "warning", "trainer"),
        ("loss_spike", 61, "info", "trainer"),
    ]
    assert evs[0]["details"]["host"] == "node-b" and evs[2]["message"] == "<b>spike</b>"
    assert [e["step"] for e in c.get("/api/runs/ev/events?kind=loss_spike").json()] == [None, 61]
    assert c.get("/api/runs/ev/events?kind=bogus").status_code == 422
    row = next(r for r in c.get("/api/runs").json() if r["id"] == "ev")
    assert row["events"] == {
        "straggler": {"count": 1, "severity": "warning"},
        "nonfinite_loss": {"count": 1, "severity": "critical"},
        "loss_spike": {"count": 2, "severity": "warning"},
    }
    assert c.get("/api/runs/ev").json()["events"]["straggler"]["count"] == 1


def test_samples_stored_once_per_step(c):
    start(c, "sa")
    post(c, td.samples("sa", 100, [("def fib(n):", "\n    return 1"), ("<script>", "x")]))
    post(c, td.samples("sa", 100, [("def fib(n):", "a replay with other text")]))
    post(c, td.samples("sa", 200, [("def fib(n):", "\n    return fib(n-1)")]))
    got = c.get("/api/runs/sa/samples").json()
    assert [(s["step"], s["max_new_tokens"]) for s in got] == [(100, 32), (200, 32)]
    assert got[0]["samples"] == [
        {"prompt": "def fib(n):", "completion": "\n    return 1"},
        {"prompt": "<script>", "completion": "x"},
    ]
    assert [s["step"] for s in c.get("/api/runs/sa/samples?limit=1").json()] == [200]


BASE = td.rank_stats("bad", 1, n=2)
ENTRY = BASE["ranks"][0]


@pytest.mark.parametrize(
    "msg,field",
    [
        ({**BASE, "ranks": [ENTRY, ENTRY]}, "each rank must appear once"),
        ({**BASE, "ranks": [{**ENTRY, "step_ms": -1.0}]}, "ranks.0.step_ms"),
        ({**BASE, "ranks": [{**ENTRY, "compute_ms": "nan"}]}, "ranks.0.compute_ms"),
        ({**BASE, "ranks": [{**ENTRY, "extra": 1}]}, "ranks.0: Value error, unknown field 'extra'"),
        ({**BASE, "ranks": [{**ENTRY, "host": "h" * 201}]}, "ranks.0.host"),
        ({**BASE, "ranks": []}, "ranks"),
        ({**BASE, "step": 2**63}, "step"),
        ({**td.timeline("bad", 1), "pp": 1}, "outside pp=1"),
        ({**td.timeline("bad", 1), "bubble_measured": 1.5}, "bubble_measured"),
        ({**td.timeline("bad", 1), "spans": [{**td.one_f_one_b(2, 4)[0], "end_ms": -1}]}, "end_ms"),
        (
            {**td.timeline("bad", 1), "spans": [{**td.one_f_one_b(2, 4)[1], "start_ms": 30.0}]},
            "before start_ms",
        ),
        ({**td.timeline("bad", 1), "spans": [{**td.one_f_one_b(2, 4)[0], "kind": "<b>"}]}, "kind"),
        (
            {**td.timeline("bad", 1), "spans": [{**td.one_f_one_b(2, 4)[0], "kind": "k" * 33}]},
            "kind",
        ),
        (
            {
                **td.timeline("bad", 1, m=8),
                "spans": [{**s, "kind": f"k{i % 17}"} for i, s in enumerate(td.one_f_one_b(2, 8))],
            },
            "17 kinds, over the limit of 16",
        ),
        (td.event("bad", "meltdown", 1), "kind"),
        (td.event("bad", "stall", 1, severity="fatal"), "severity"),
        (td.event("bad", "stall", 1, message="m" * 2001), "message"),
        (td.event("bad", "stall", 1, message=""), "message"),
        (td.event("bad", "stall", 1, details={"x": "y" * 17000}), "over the 16384-byte limit"),
        (td.event("bad", "stall", 1, details={"d": json.loads("[" * 70 + "]" * 70)}), "deeper"),
        (td.event("bad", "stall", 1, details={"ratio": float("nan")}), "NaN or infinite"),
        (td.samples("bad", 1, [("p", "c")] * 65), "samples"),
        (td.samples("bad", 1, [("p" * 4001, "c")]), "samples.0.prompt"),
        (td.samples("bad", 1, [("p", "c" * 16001)]), "samples.0.completion"),
        ({**td.samples("bad", 1, [("p", "c")]), "extra": True}, "extra"),
    ],
)
def test_bad_telemetry_is_a_422_naming_the_field(c, msg, field):
    r = c.post("/api/ingest", content=json.dumps(msg))
    assert r.status_code == 422, r.text
    assert field in r.json()["errors"][0]["error"], r.json()
    assert c.get("/api/runs/bad").status_code == 404  # nothing stored, not even the run


def test_bad_telemetry_on_the_websocket_is_an_error_frame_and_it_stays_open(c):
    start(c, "wsb")
    with c.websocket_connect(WS + "/ws/ingest") as ws:
        for bad in (
            td.event("wsb", "meltdown", 1),
            {**td.rank_stats("wsb", 1), "ranks": []},
            td.samples("wsb", 1, [("p", "c")] * 65),
        ):
            ws.send_text(json.dumps(bad))
            reply = ws.receive_json()
            assert reply["ok"] is False and reply["status"] == 422, reply
        ws.send_text(json.dumps({**td.straggler("wsb", 5), "ack": 9}))
        assert ws.receive_json() == {"ok": True, "type": "ack", "ack": 9}
    assert [e["kind"] for e in c.get("/api/runs/wsb/events").json()] == ["straggler"]


def test_queue_accounting_covers_what_a_parsed_telemetry_message_takes():
    """The writer queue is bounded in bytes by an estimate; for compact rank_stats and
    timelines (many small models) the estimate must not undercount what parsing allocates."""
    mini = {"rank": 0, "dp": 0, "tp": 0, "pp": 0, "step_ms": 1}
    cases = [
        {"type": "rank_stats", "run_id": "m", "step": 1,
         "ranks": [{**mini, "rank": i} for i in range(5000)]},
        td.timeline("m", 1, pp=8, m=400),
    ]  # fmt: skip
    for msg in cases:
        raw = json.dumps(msg, separators=(",", ":"))
        tracemalloc.start()
        parsed = parse_messages(raw)
        used, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert ingest._cost(len(raw), 1, parsed[0]) >= used, (msg["type"], used)
        assert ingest.MEMORY_PER_JSON_BYTE * len(raw) < used or msg["type"] != "rank_stats"


def test_restart_is_derived_from_a_new_attempt(c):
    start(c, "rst", attempt="a", time=100.0)
    post(c, {"type": "metrics", "run_id": "rst", "step": 5, "values": {"lm_loss": 1.0}})
    start(c, "rst", attempt="a", time=100.0)  # a reconnect of the same launch: no restart
    assert c.get("/api/runs/rst/events").json() == []
    start(c, "rst", attempt="b", time=200.0)
    start(c, "rst", attempt="b", time=200.0)  # replayed
    start(c, "rst2", attempt="x")  # a first launch is no restart
    evs = c.get("/api/runs/rst/events").json()
    assert [(e["kind"], e["step"], e["source"], e["time"]) for e in evs] == [
        ("restart", 5, "dashboard", 200.0)
    ]
    assert evs[0]["details"] == {"attempt": "b", "launches": 2, "last_step": 5}
    assert evs[0]["message"] == "run restarted (launch 2) after step 5"
    assert c.get("/api/runs/rst2/events").json() == []


def wait_for(fn, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_stall_is_derived_once_per_silence(tmp_path):
    app = create_app(Settings(db=str(tmp_path / "s.db"), stall_after=0.4))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as s:

        def stalls():
            return [e for e in s.get("/api/runs/quiet/events").json() if e["kind"] == "stall"]

        post(s, {"type": "run_start", "run_id": "quiet"})
        post(s, {"type": "metrics", "run_id": "quiet", "step": 7, "values": {"lm_loss": 1.0}})
        post(s, {"type": "run_start", "run_id": "done"})
        post(s, {"type": "run_end", "run_id": "done", "status": "finished"})
        first = wait_for(stalls)
        time.sleep(1.0)  # several more checks (every 0.2 s) during the same silence
        assert stalls() == first and len(first) == 1
        ev = first[0]
        assert (ev["step"], ev["severity"], ev["source"]) == (7, "critical", "dashboard")
        assert ev["details"]["stall_after_s"] == 0.4
        assert ev["message"].startswith("no message from the trainer for 0.4 s (last at ")
        post(s, {"type": "heartbeat", "run_id": "quiet"})  # alive again, then silent again
        wait_for(lambda: len(stalls()) == 2)
        assert s.get("/api/runs/done/events").json() == []  # a finished run never stalls


def test_tags_and_note_need_csrf_and_filter_the_run_list(c):
    for rid in ("t1", "t2", "t3"):
        start(c, rid)
    csrf = {"X-CSRF-Token": c.csrf}
    body = {"tags": ["baseline", "lr:3e-4", "baseline"], "note": "<i>first</i> try"}
    assert c.patch("/api/runs/t1", json=body).status_code == 403  # no CSRF token
    evil = {**csrf, "Origin": "http://evil.example"}
    assert c.patch("/api/runs/t1", json=body, headers=evil).status_code == 403
    r = c.patch("/api/runs/t1", json=body, headers=csrf)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "t1", "tags": ["baseline", "lr:3e-4"], "note": "<i>first</i> try"}
    assert c.patch("/api/runs/t3", json={"tags": ["baseline"]}, headers=csrf).status_code == 200
    r = c.patch("/api/runs/t1", json={"note": "second"}, headers=csrf)  # tags stay
    assert r.json()["tags"] == ["baseline", "lr:3e-4"]
    run = c.get("/api/runs/t1").json()
    assert run["tags"] == ["baseline", "lr:3e-4"] and run["note"] == "second"
    assert [r["id"] for r in c.get("/api/runs?tag=baseline").json()] == ["t3", "t1"]
    assert [r["id"] for r in c.get("/api/runs?tag=lr:3e-4").json()] == ["t1"]
    assert c.get("/api/runs?tag=nothing").json() == []
    page = c.get("/api/runs?tag=baseline&limit=1")
    assert [r["id"] for r in page.json()] == ["t3"]
    nxt = c.get(f"/api/runs?tag=baseline&limit=1&cursor={page.headers['X-Next-Cursor']}")
    assert [r["id"] for r in nxt.json()] == ["t1"] and "X-Next-Cursor" not in nxt.headers
    for bad, why in (
        ({"tags": ["has space"]}, "tags.0"),
        ({"tags": ["x" * 65]}, "tags.0"),
        ({"tags": [f"t{i}" for i in range(33)]}, "tags"),
        ({"note": "n" * 10_001}, "note"),
        ({"note": "a\x00b"}, "note"),
        ({"color": "red"}, "color"),
        ({}, "send"),
    ):
        r = c.patch("/api/runs/t2", json=bad, headers=csrf)
        assert r.status_code == 422 and why in r.json()["detail"], (bad, r.text)
    r = c.patch("/api/runs/t2", content=b"tags=x", headers={**csrf, "content-type": "text/plain"})
    assert r.status_code == 415
    r = c.patch("/api/runs/t2", content=b"{" + b" " * 70_000 + b"}", headers=csrf)
    assert r.status_code == 413
    assert c.patch("/api/runs/nope", json={"note": "x"}, headers=csrf).status_code == 404
    assert c.get("/api/runs/t2").json()["tags"] == []


def test_cross_origin_reads_of_the_new_endpoints_are_refused(c):
    evil = {"Origin": "http://evil.example"}
    for path in ("rank_stats", "timelines", "timelines/1", "events", "samples"):
        r = c.get(f"/api/runs/ev/{path}", headers=evil)
        assert r.status_code == 403 and "cross-origin" in r.json()["detail"], path


def test_live_feed_forwards_notices_of_the_new_types(c):
    start(c, "lv")
    with c.websocket_connect(WS + "/ws/runs/lv") as sub:
        time.sleep(0.2)  # subscribed
        post(c, td.rank_stats("lv", 10))
        post(c, td.timeline("lv", 10))
        post(c, td.straggler("lv", 10))
        post(c, td.samples("lv", 10, [("p", "c")]))
        got = []
        while len(got) < 4:
            msg = sub.receive_json()
            if msg["type"] not in ("run_changed", "points"):
                got.append(msg)
    assert [(m["type"], m["step"], m["run_id"]) for m in got] == [
        ("rank_stats", 10, "lv"),
        ("pipeline_timeline", 10, "lv"),
        ("event", 10, "lv"),
        ("samples", 10, "lv"),
    ]
    assert got[2]["kind"] == "straggler" and got[2]["severity"] == "warning"


def test_an_older_database_gets_the_new_tables_and_delete_removes_telemetry(tmp_path):
    db = tmp_path / "old.db"
    app = create_app(Settings(db=str(db)))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as s:
        post(s, {"type": "run_start", "run_id": "old"})
        post(s, {"type": "metrics", "run_id": "old", "step": 1, "values": {"lm_loss": 2.0}})
    con = sqlite3.connect(db)  # as a file written before the telemetry tables
    for t in ("rank_stats", "timelines", "events", "samples", "run_labels", "run_stall"):
        con.execute(f"DROP TABLE {t}")
    con.execute("DROP TABLE predictions")  # as a file of the release before predictions
    con.commit()
    con.close()
    app = create_app(Settings(db=str(db)))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as s:
        assert s.get("/api/runs/old").json()["step"] == 1
        post(s, td.rank_stats("old", 2))
        post(s, td.straggler("old", 2))
        post(s, td.straggler("old", 2))  # the replay index came back with the table
        post(s, td.samples("old", 2, [("p", "c")]))
        post(s, td.timeline("old", 2))
        post(s, {**td.PREDICTION, "run_id": "old"})
        assert s.get("/api/runs/old/prediction").json()["predicted"]["step_ms"] == 300.0
        assert len(s.get("/api/runs/old/events").json()) == 1
        csrf = {"X-CSRF-Token": s.get("/api/session").json()["csrf"]}
        assert s.patch("/api/runs/old", json={"tags": ["x"]}, headers=csrf).status_code == 200
        assert s.delete("/api/runs/old", headers=csrf).status_code == 200
    con = sqlite3.connect(db)
    for t in ("rank_stats", "timelines", "events", "samples", "run_labels", "predictions"):
        assert con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] == 0, t
    con.close()


def test_silence_while_the_dashboard_was_down_counts_from_its_start(tmp_path):
    app = create_app(Settings(db=str(tmp_path / "d.db")))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as s:
        post(s, {"type": "run_start", "run_id": "z"})
        hb = s.get("/api/runs/z").json()["updated"]
    engine = app.state.engine  # disposed, reconnects on use
    check = StallCheck(300.0, started=hb + 3600)  # a server started an hour later
    with engine.begin() as conn:
        assert check(conn, now=hb + 3600 + 299) == []  # up for 299 s: not yet
        evs = check(conn, now=hb + 3600 + 300)
        assert [(e["run_id"], e["kind"]) for e in evs] == [("z", "stall")]
        assert check(conn, now=hb + 3600 + 900) == []  # the same silence: once
    engine.dispose()
