"""Issue 44, findings 8-10: the PostgreSQL connection as an asset. Its secrets never printed,
its one-server lock kept or re-taken when the connection drops (never two writers), and an
outage answered 503 with Retry-After and two log lines, then recovered with nothing acked
lost. A real PostgreSQL server (pg_server.py); the outage test stops one of its own."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import psycopg
import pytest
from dashboard_helpers import start_dashboard

from nanotron_dashboard.cli import main


def test_secrets_in_the_url_are_never_printed(pg_server, tmp_path, capsys):
    """Finding 8: a `?password=` was printed verbatim at startup and in connection errors."""
    passfile = tmp_path / "pgpass"
    passfile.write_text("127.0.0.1:9:*:*:pfsecret\n")
    passfile.chmod(0o600)
    bad = "postgresql://u:up4ss@127.0.0.1:9/none?password=s3cret&sslpassword=k3yp4ss"
    for url in (bad, f"postgresql://u@127.0.0.1:9/none?passfile={passfile}"):
        assert main(["--db", url, "--port", "1"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "cannot connect" in err, err
        for secret in ("up4ss", "s3cret", "k3yp4ss", "pfsecret"):
            assert secret not in err, err
    db = pg_server.fresh_database() + "?password=s3cret&sslpassword=k3yp4ss"
    d = start_dashboard(db)  # trust authentication: the password is not checked
    try:
        with pytest.raises(RuntimeError) as second:  # the lock's refusal names the URL too
            start_dashboard(db)
    finally:
        d.stop()
    out = d.proc.stdout.read().decode() + str(second.value)
    assert "serving postgresql://postgres@127.0.0.1" in out and "password=***" in out, out
    assert "s3cret" not in out and "k3yp4ss" not in out, out


def _post(d, msgs) -> tuple[int, dict, str | None]:
    req = urllib.request.Request(d.url + "/api/ingest", data=json.dumps(msgs).encode())
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read()), r.headers.get("Retry-After")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers.get("Retry-After")


def _metric(run_id: str, step: int) -> dict:
    return {"type": "metrics", "run_id": run_id, "step": step, "values": {"loss": float(step)}}


def _cut(pg_server, db: str) -> int:
    """pg_terminate_backend on every session of the database (what a restart does to them)."""
    name = db.rsplit("/", 1)[1].split("?")[0]
    with psycopg.connect(pg_server.url, autocommit=True) as c:
        rows = c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
            "AND pid <> pg_backend_pid()",
            (name,),
        ).fetchall()
    time.sleep(0.3)
    return len(rows)


def _steps(d, run_id: str) -> list[int]:
    return d.get(f"/api/runs/{run_id}/metrics?names=loss")["series"]["loss"]["step"]


def test_the_lock_is_taken_again_or_the_server_stops_writing(pg_server):
    """Finding 9: with its connection cut, the first server lost its lock, kept writing, and
    a second one started and wrote too."""
    db = pg_server.fresh_database()
    a = start_dashboard(db)
    b = None
    try:
        assert _post(a, [{"type": "run_start", "run_id": "a"}, _metric("a", 1)])[0] == 200
        assert _cut(pg_server, db) >= 1
        # nobody else took it: A's next write takes the lock again (once its connection is
        # new: the write on the cut one is refused with Retry-After, as in an outage)
        for _ in range(10):
            status, _, _ = _post(a, [_metric("a", 2)])
            if status == 200:
                break
            time.sleep(0.2)
        assert status == 200
        with pytest.raises(RuntimeError, match="another nanotron-dashboard is serving"):
            start_dashboard(db)
        # cut again, and B starts first: A must refuse to write from then on
        _cut(pg_server, db)
        b = start_dashboard(db)
        assert _post(b, [{"type": "run_start", "run_id": "b"}, _metric("b", 1)])[0] == 200
        for _ in range(3):
            status, body, retry = _post(a, [_metric("a", 3)])
            assert status == 503 and retry, (status, body)
        assert "another nanotron-dashboard serves this database" in json.dumps(body)
        assert _post(b, [_metric("b", 2)])[0] == 200
        assert _steps(b, "a") == [1, 2] and _steps(b, "b") == [1, 2]
    finally:
        a.stop()
        if b is not None:
            b.stop()
    log = a.proc.stdout.read().decode()
    assert "Traceback" not in log, log
    # one line per cut, one per recovery, one for the lock B took
    assert log.count("database is unavailable") == 2 and log.count("database is back") == 1, log
    assert log.count("took this database's lock") == 1, log


def _ws_during_outage(d) -> tuple[list[dict], int | None]:
    """A point sent over /ws/ingest with an ack while the database is down: the replies, and
    the close code."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    replies = []
    with connect(d.url.replace("http", "ws") + "/ws/ingest", open_timeout=10) as ws:
        ws.send(json.dumps({**_metric("r", 10**6), "ack": 7}))
        try:
            while True:
                replies.append(json.loads(ws.recv(timeout=10)))
        except ConnectionClosed as e:
            return replies, e.rcvd.code if e.rcvd else None


def test_an_outage_is_503s_two_log_lines_and_nothing_acked_lost():
    """Finding 10: PostgreSQL stopped for seconds during ingest was a flood of 500s and
    tracebacks. Now: 503 with Retry-After (which the trainer's client honours), one line when
    it starts and one when it ends, and every acknowledged point stored."""
    from pg_server import start

    server = start()  # its own: this test stops it
    d = start_dashboard(server.fresh_database())
    acked: list[int] = []
    seen: dict[int, int] = {}
    retry_ok = []
    stop = threading.Event()

    def trainer() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            while not stop.is_set():  # the same point until it is stored, as the client does
                status, _, retry = _post(d, [_metric("r", step)])
                seen[status] = seen.get(status, 0) + 1
                if status == 200:
                    acked.append(step)
                    break
                retry_ok.append(status == 503 and retry is not None)
                time.sleep(0.2)  # Retry-After says 2 s: faster here, to see more 503s
            time.sleep(0.02)

    def reader() -> None:
        while not stop.is_set():
            try:
                d.get("/api/runs/r")
                seen["read 200"] = seen.get("read 200", 0) + 1
            except urllib.error.HTTPError as e:
                seen[f"read {e.code}"] = seen.get(f"read {e.code}", 0) + 1
                retry_ok.append(e.code == 503 and e.headers.get("Retry-After") is not None)
            time.sleep(0.05)

    threads = [threading.Thread(target=trainer), threading.Thread(target=reader)]
    assert _post(d, {"type": "run_start", "run_id": "r"})[0] == 200
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        server.pause()
        time.sleep(1.0)
        ws_replies, ws_close = _ws_during_outage(d)
        time.sleep(3.0)
        server.resume()
        deadline = time.monotonic() + 20
        before = len(acked)
        while time.monotonic() < deadline and len(acked) < before + 20:
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(30)
        stored = _steps(d, "r")
    finally:
        stop.set()
        d.stop()
        server.stop()
    log = d.proc.stdout.read().decode()
    # a websocket trainer: its point refused with 503, then closed to reconnect and replay
    assert ws_replies[0]["status"] == 503 and ws_replies[0]["ack"] == 7, ws_replies
    assert ws_close == 1013, ws_close
    assert seen.get(503, 0) >= 1 and seen.get("read 503", 0) >= 1, seen
    assert set(seen) <= {200, 503, "read 200", "read 503"} and all(retry_ok), seen
    assert len(acked) >= before + 20, (seen, len(acked))  # recovered
    assert set(acked) <= set(stored), sorted(set(acked) - set(stored))[:10]
    assert "Traceback" not in log, log[-3000:]
    lines = [x for x in log.splitlines() if x.strip() and "serving" not in x]
    assert log.count("the database is unavailable") == 1, log[-3000:]
    assert log.count("the database is back") == 1 and len(lines) <= 4, log[-3000:]
