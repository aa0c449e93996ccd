"""Input hardening (security review findings 6-12): hostile or broken input gets a 4xx with a reason (never a 500,
never a dropped websocket), stored data stays readable, memory and the database stay bounded."""

from __future__ import annotations

import csv
import io
import json
import logging
import sqlite3
import threading
import time
from urllib.parse import quote

import pytest
from dashboard_helpers import JSON_HEADERS, LOCAL, WS
from fastapi.testclient import TestClient

from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.cli import main
from nanotron_dashboard.errors import DatabaseFileError
from nanotron_dashboard.messages import MAX_METRIC_NAMES
from nanotron_dashboard.series import SeriesCache

BIG = 2**63


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inputs")
    app = create_app(Settings(db=str(tmp / "in.db")))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as client:
        client.tmp = tmp  # type: ignore[attr-defined]
        assert (
            client.post("/api/ingest", json={"type": "run_start", "run_id": "base"}).status_code
            == 200
        )
        ok = {"type": "metrics", "run_id": "base", "step": 1, "values": {"lm_loss": 2.0}}
        assert client.post("/api/ingest", json=ok).status_code == 200
        yield client


def snapshot(c, run_id="base"):
    run = c.get(f"/api/runs/{run_id}").json()
    run.pop("age_s")
    return run, c.get(f"/api/runs/{run_id}/metrics").json()["series"]


def refused(c, msg, status=422, contains=""):
    r = c.post("/api/ingest", content=msg if isinstance(msg, (str, bytes)) else json.dumps(msg))
    assert r.status_code == status, (r.status_code, r.text)
    text = r.text
    assert contains in text, text
    return r


def test_finding6_out_of_contract_numbers_and_nesting_are_4xx(c):
    before = snapshot(c)
    m = {"type": "metrics", "run_id": "base", "values": {"lm_loss": 1.0}}
    refused(c, {**m, "step": BIG}, contains="step")
    refused(c, {"type": "run_start", "run_id": "base", "world_size": BIG}, contains="world_size")
    ck = {"type": "checkpoint", "run_id": "base", "step": 1, "path": "p"}
    refused(c, {**ck, "consumed_tokens": BIG}, contains="consumed_tokens")
    refused(c, {**ck, "size": BIG}, contains="size")
    refused(c, "[" * 3000, status=400, contains="deeper than 64")
    refused(
        c,
        '{"type":"metrics","run_id":"base","step":2,"values":{"a":1},"time":NaN}',
        contains="time",
    )
    assert snapshot(c) == before
    # over the websocket: an error frame each, the connection stays open, nothing stored
    with c.websocket_connect(WS + "/ws/ingest") as ws:
        for bad in (
            json.dumps({**m, "step": BIG}),
            "[" * 3000,
            '{"type":"metrics","run_id":"base","step":2,"values":{"a":1},"time":NaN}',
        ):
            ws.send_text(bad)
            reply = ws.receive_json()
            assert reply["ok"] is False and reply["status"] == 422, reply
        ws.send_json({"type": "heartbeat", "run_id": "base", "ack": 7})
        assert ws.receive_json()["ack"] == 7
    after = snapshot(c)
    assert after[1] == before[1] and after[0]["step"] == before[0]["step"]


def test_finding7_values_that_would_break_a_run_for_good(c):
    refused(
        c,
        '{"type":"metrics","run_id":"r7","step":1,"values":{"a":1},"time":Infinity}',
        contains="time",
    )
    refused(
        c,
        {"type": "metrics", "run_id": "r7", "step": 1, "values": {"consumed_tokens": "nan"}},
        contains="consumed_tokens",
    )
    deep: dict = {}
    node = deep
    for _ in range(900):
        node["a"] = {}
        node = node["a"]
    refused(c, {"type": "run_start", "run_id": "r7", "config": deep}, 400, "recursion limit")
    ok_depth: dict = {}
    node = ok_depth
    for _ in range(63):  # 64 levels with the outer dict: the limit itself is fine
        node["a"] = {}
        node = node["a"]
    refused(c, {"type": "run_start", "run_id": "r7", "config": {"x": ok_depth}}, contains="config")
    for bad_id in ("a\x00b", "a/b", "..", "x" * 201, "r\u00e9"):
        refused(c, {"type": "run_start", "run_id": bad_id}, contains="run_id")
    assert c.get("/api/runs/a%00b").status_code == 404
    assert {r["id"] for r in c.get("/api/runs?limit=1000").json()} == {"base"}  # none created
    # what is accepted reads back exactly: the deepest config, the largest step, NaN values
    assert (
        c.post(
            "/api/ingest", json={"type": "run_start", "run_id": "r7", "config": ok_depth}
        ).status_code
        == 200
    )
    assert c.get("/api/runs/r7").json()["config"] == ok_depth
    top = 2**63 - 1
    c.post(
        "/api/ingest",
        content='[{"type":"metrics","run_id":"r7","step":5,"values":{"loss":NaN,"consumed_tokens":10}},'
        f'{{"type":"metrics","run_id":"r7","step":{top},"values":{{"loss":1.5,"consumed_tokens":20}}}}]',
    )
    s = c.get("/api/runs/r7/metrics?names=loss").json()["series"]["loss"]
    assert s["step"] == [5, top] and s["y"] == [None, 1.5]
    for axis in ("time", "tokens"):
        assert c.get(f"/api/runs/r7/metrics?x={axis}").status_code == 200
    rows = list(csv.reader(io.StringIO(c.get("/api/runs/r7/metrics.csv").text)))
    assert rows[-1][0] == str(top)
    run = c.get("/api/runs/r7").json()
    assert run["nonfinite"] == {"step": 5, "metric": "loss"}  # the NaN badge
    # a database written before these checks may hold an infinite time: views still answer
    c.post(
        "/api/ingest",
        json=[
            {"type": "metrics", "run_id": "old", "step": k, "values": {"loss": 1.0}} for k in (1, 2)
        ],
    )
    with sqlite3.connect(c.tmp / "in.db") as db:
        pk = db.execute("SELECT pk FROM runs WHERE id='old'").fetchone()[0]
        db.execute("UPDATE metrics SET time=? WHERE run_pk=? AND step=1", (float("inf"), pk))
    c.app.state.cache.drop_run(pk)
    r = c.get("/api/runs/old/metrics?x=time&names=loss")
    assert r.status_code == 200 and r.json()["series"]["loss"]["step"] == [2]


def test_finding8_metric_names_bounded_run_list_paginated_and_runs_deletable(c, tmp_path):
    names = {f"m{i}": 1.0 for i in range(MAX_METRIC_NAMES)}
    assert (
        c.post(
            "/api/ingest", json={"type": "metrics", "run_id": "wide", "step": 1, "values": names}
        ).status_code
        == 200
    )
    r = refused(
        c,
        {"type": "metrics", "run_id": "wide", "step": 2, "values": {"one_more": 1.0}},
        contains="limit of 1000",
    )
    assert r.json()["accepted"] == 0
    assert len(c.get("/api/runs/wide").json()["metric_names"]) == MAX_METRIC_NAMES
    refused(
        c,
        {"type": "metrics", "run_id": "wide", "step": 2, "values": {"a,b": 1.0}},
        contains="values",
    )
    refused(
        c,
        {"type": "metrics", "run_id": "wide", "step": 2, "values": {"x" * 201: 1.0}},
        contains="values",
    )

    starts = [
        {"type": "run_start", "run_id": f"page-{i:03d}", "project": "pg", "time": 1000.0 + i}
        for i in range(250)
    ]
    assert c.post("/api/ingest", json=starts).status_code == 200
    seen, cursor, pages = [], None, 0
    while True:
        r = c.get("/api/runs?project=pg&limit=100" + (f"&cursor={quote(cursor)}" if cursor else ""))
        seen += [x["id"] for x in r.json()]
        pages += 1
        cursor = r.headers.get("x-next-cursor")
        if not cursor:
            break
        assert 'rel="next"' in r.headers["link"]
    assert pages == 3 and seen == [f"page-{i:03d}" for i in reversed(range(250))]
    assert len(c.get("/api/runs").json()) == 100  # a default page, not every run
    assert c.get("/api/runs?cursor=garbage").status_code == 400

    # delete: the API needs the CSRF token; the series go with the run
    assert c.delete("/api/runs/wide").status_code == 403
    csrf = c.get("/api/session").json()["csrf"]
    assert c.delete("/api/runs/wide", headers={"X-CSRF-Token": csrf}).json() == {"deleted": "wide"}
    assert c.get("/api/runs/wide").status_code == 404
    with sqlite3.connect(c.tmp / "in.db") as db:
        assert db.execute("SELECT COUNT(*) FROM metrics WHERE name='m5'").fetchone()[0] == 0
    assert c.delete("/api/runs/wide", headers={"X-CSRF-Token": csrf}).status_code == 404

    # the CLI: refused while a server holds the file, works on a file no server serves
    assert main(["delete-run", "--db", str(c.tmp / "in.db"), "page-000"]) == 2
    db = tmp_path / "cli.db"
    with TestClient(create_app(Settings(db=str(db))), base_url=LOCAL) as other:
        other.post("/api/ingest", json={"type": "run_start", "run_id": "gone", "attempt": "a1"})
        other.post(
            "/api/ingest", json={"type": "metrics", "run_id": "gone", "step": 1, "values": {"a": 1}}
        )
    assert main(["delete-run", "--db", str(db), "gone"]) == 0
    assert main(["delete-run", "--db", str(db), "gone"]) == 2
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0
        assert con.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 0
        assert con.execute("SELECT COUNT(*) FROM run_attempts").fetchone()[0] == 0


def test_finding9_memory_is_bounded_in_bytes(c, tmp_path):
    cache = c.app.state.cache
    n_before = len(cache)
    junk = ",".join(f"junk{i}" for i in range(5000))
    r = c.get(f"/api/runs/base/metrics?names=lm_loss,{junk}")
    assert r.status_code == 200 and list(r.json()["series"]) == ["lm_loss"]
    assert len(r.json()["unknown"]) == 100  # reported (capped), never looked up
    assert len(cache) <= n_before + 1
    # the cache counts empty series too: a budget of 10 entries' overhead holds about 10
    small = SeriesCache(lambda pk, name: ([], [], []), max_bytes=10 * 600)
    import numpy as np

    small._loader = lambda pk, name: (np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    for i in range(1000):
        small.get(1, f"n{i}")
    assert len(small) <= 12 and small.nbytes <= 10 * 600

    # the writer queue is bounded in bytes: HTTP ingest gets 503 + Retry-After, then recovers
    app = create_app(Settings(db=str(tmp_path / "q.db"), queue_bytes=64 << 10))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as q:
        gate = threading.Event()
        writer = app.state.writer
        busy = threading.Event()
        writer.submit(lambda conn: (busy.set(), gate.wait(30)))  # the writer is busy ...
        assert busy.wait(10)
        from nanotron_dashboard.messages import Heartbeat

        filler = Heartbeat(type="heartbeat", run_id="q", time=1.0)
        assert writer.try_put([(filler, None, 60 << 10)])  # ... and its queue nearly full
        msg = [
            {"type": "metrics", "run_id": "q", "step": s, "values": {"a": 1.0}} for s in range(500)
        ]
        assert not writer.try_put([(filler, None, 8 << 10)])
        r = q.post("/api/ingest", content=json.dumps(msg))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert writer.queued_bytes == 60 << 10
        # over the websocket the message waits for room instead (its ack comes later)
        with q.websocket_connect(WS + "/ws/ingest") as ws:
            ws.send_text(json.dumps(msg[:300] + [{"type": "heartbeat", "run_id": "q", "ack": 3}]))
            time.sleep(0.5)
            assert writer.queued_bytes <= 64 << 10  # not grown past the budget meanwhile
            gate.set()
            assert ws.receive_json() == {"ok": True, "type": "ack", "ack": 3}
        deadline = time.monotonic() + 20
        while app.state.writer.queued_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert q.post("/api/ingest", content=json.dumps(msg)).status_code == 200
        assert q.get("/api/runs/q").json()["step"] == 499


def test_finding10_corrupt_file_second_server_and_full_disk(tmp_path, caplog):
    db = tmp_path / "c.db"
    app = create_app(Settings(db=str(db)))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as t:
        # a second server on the same file refuses to start, naming the file
        with pytest.raises(DatabaseFileError, match="another nanotron-dashboard"):
            create_app(Settings(db=str(db)))
        t.post("/api/ingest", json={"type": "run_start", "run_id": "d"})
        # a full disk (SQLite's page limit stands in for it): 507, one log line, recovery
        pages = app.state.writer.submit(
            lambda conn: conn.exec_driver_sql("PRAGMA page_count").scalar(), want_result=True
        ).result()
        app.state.writer.submit(lambda conn: conn.exec_driver_sql(f"PRAGMA max_page_count={pages}"))
        big = [
            {
                "type": "metrics",
                "run_id": "d",
                "step": s,
                "values": {f"v{i}": 1.0 for i in range(20)},
            }
            for s in range(400)
        ]
        with caplog.at_level(logging.ERROR, logger="nanotron_dashboard"):
            codes = [t.post("/api/ingest", content=json.dumps(big)).status_code for _ in range(3)]
        assert codes == [507, 507, 507]
        lines = [r for r in caplog.records if "disk is full" in r.getMessage()]
        assert len(lines) == 1 and lines[0].exc_info is None
        app.state.writer.submit(
            lambda conn: conn.exec_driver_sql("PRAGMA max_page_count=1073741823")
        )
        assert t.post("/api/ingest", content=json.dumps(big)).status_code == 200
        assert t.get("/api/runs/d").json()["step"] == 399
        con = sqlite3.connect(db)
        con.executemany(
            "INSERT INTO metrics(run_pk, name, step, value, time) VALUES (1, 'pad', ?, 1.0, 0)",
            [(s,) for s in range(20000)],
        )
        con.commit()
        con.close()
    assert not (tmp_path / "c.db-wal").exists()  # everything is in the file itself
    # a corrupted file: random bytes over some of its pages
    import random

    data = bytearray(db.read_bytes())
    rng = random.Random(0)
    for page in range(3, len(data) // 4096 - 1, 3):
        data[page * 4096 : (page + 1) * 4096] = rng.randbytes(4096)
    db.write_bytes(bytes(data))
    with pytest.raises(DatabaseFileError) as e:  # (main() prints it as one line, exit 2)
        create_app(Settings(db=str(db)))
    assert f"--db {db} is corrupt" in str(e.value) and "sqlite3 " in str(e.value), e.value
    assert ".recover" in str(e.value)


def test_finding11_csv_is_quoted_defused_and_named_safely(c):
    names = {'=HYPERLINK("http://evil")': 1.0, 'a"b': 2.0, "+1": 3.0, "plain": 4.0}
    c.post("/api/ingest", json={"type": "run_start", "run_id": "csv-run"})
    c.post("/api/ingest", json={"type": "metrics", "run_id": "csv-run", "step": 1, "values": names})
    # names written by an older release may hold a comma; and ids anything (CJK here)
    with sqlite3.connect(c.tmp / "in.db") as db:
        pk = db.execute("SELECT pk FROM runs WHERE id='csv-run'").fetchone()[0]
        db.execute("INSERT INTO metrics VALUES (?, 'loss,fake', 1, 5.0, 0)", (pk,))
        db.execute("INSERT INTO latest VALUES (?, 'loss,fake', 1, 5.0)", (pk,))
        db.execute(
            "INSERT INTO runs(id, project, name, status, config, topology, command) VALUES ('運行-1', '', '', 'finished', '{}', '{}', '[]')"
        )
    rows = list(csv.reader(io.StringIO(c.get("/api/runs/csv-run/metrics.csv").text)))
    header = dict(zip(rows[0], rows[1]))
    assert header == {
        "step": "1",
        "'+1": "3.0",
        '\'=HYPERLINK("http://evil")': "1.0",
        'a"b': "2.0",
        "loss,fake": "5.0",
        "plain": "4.0",
    }
    r = c.get("/api/runs/" + quote("運行-1") + "/metrics.csv")
    assert r.status_code == 200
    assert r.headers["content-disposition"] == (
        "attachment; filename=\"__-1.csv\"; filename*=UTF-8''%E9%81%8B%E8%A1%8C-1.csv"
    )


def test_finding12_checkpoint_files_must_stay_in_their_folder(c, tmp_path):
    root = tmp_path / "cks"
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 12345)
    for step, files in (
        (10, [{"path": "model.safetensors", "size": 100}]),
        (20, [{"path": str(secret)}]),
        (30, [{"path": "../../secret.bin"}, {"path": "model.safetensors", "size": 100}]),
    ):
        d = root / str(step)
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"m" * 100)
        (d / "checkpoint_metadata.json").write_text(json.dumps({"step": step, "files": files}))
    c.post(
        "/api/ingest",
        json={
            "type": "run_start",
            "run_id": "ckr",
            "checkpoints_path": str(root),
            "cwd": str(tmp_path),
        },
    )
    cks = c.get("/api/runs/ckr/checkpoints").json()
    assert [(k["step"], k["size"], k["complete"], k["id"]) for k in cks] == [
        (10, 100, True, None),
        (20, 0, False, None),  # /etc/shadow's size is not reported
        (30, 100, False, None),
    ]
    with sqlite3.connect(c.tmp / "in.db") as db:  # a GET never writes
        assert (
            db.execute(
                "SELECT COUNT(*) FROM checkpoints c JOIN runs r ON r.pk=c.run_pk WHERE r.id='ckr'"
            ).fetchone()[0]
            == 0
        )
    assert c.post("/api/runs/ckr/checkpoints/scan").status_code == 403  # a write needs CSRF
    csrf = c.get("/api/session").json()["csrf"]
    stored = c.post("/api/runs/ckr/checkpoints/scan", headers={"X-CSRF-Token": csrf}).json()
    assert [k["step"] for k in stored] == [10, 20, 30] and all(k["id"] for k in stored)
