"""A hostile or buggy trainer over the server's life: memory held after deletes, files it
points at, inputs that used to be 500s, and secrets in the log at every level."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request

import pytest
from dashboard_helpers import JSON_HEADERS, LAUNCH_TOKEN, LOCAL, start_dashboard
from fastapi.testclient import TestClient

from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.checkpoints import METADATA, scan_checkpoints
from nanotron_dashboard.memory import BASELINE_BYTES, MEMORY_BUDGET_BYTES


def test_memory_is_released_on_delete_and_stays_in_budget(tmp_path):
    """A few soak cycles (bench/dashboard_soak.py runs minutes of them): new runs and metric
    names every cycle, read, deleted; nothing keyed by a run or a metric stays behind."""
    settings = Settings(db=str(tmp_path / "m.db"), cache_bytes=1 << 20)
    with TestClient(create_app(settings), base_url=LOCAL, headers=JSON_HEADERS) as c:
        csrf = c.get("/api/session").json()["csrf"]
        for cycle in range(3):
            ids = [f"c{cycle}-r{i}" for i in range(4)]
            for run_id in ids:
                c.post("/api/ingest", json={"type": "run_start", "run_id": run_id})
                values = {f"c{cycle}_m{j}": 1.0 for j in range(30)}
                body = [
                    {"type": "metrics", "run_id": run_id, "step": s, "values": values}
                    for s in range(0, 1200, 4)
                ]
                assert c.post("/api/ingest", json=body).status_code == 200
                assert len(c.get(f"/api/runs/{run_id}/metrics").json()["series"]) == 30
            mem = c.get("/api/memory").json()
            assert mem["bytes"]["series_cache"] <= 1 << 20  # the cache's cap, empty series too
            assert mem["held"]["names"] == 120 and mem["held"]["series_bounds"] == 120
            for run_id in ids:
                assert c.delete(f"/api/runs/{run_id}", headers={"X-CSRF-Token": csrf}).json()
            mem = c.get("/api/memory").json()
            held = {k: v for k, v in mem["held"].items() if k != "checkpoint_metadata"}
            assert held == {
                "series": 0,
                "runs": 0,
                "names": 0,
                "series_bounds": 0,
                "live_feeds": 0,
            }, cycle
            assert mem["bytes"]["series_cache"] == mem["bytes"]["writer_index"] == 0
        assert c.get("/api/runs").json() == []
    # the default caps fit the documented budget with the idle process
    caps = create_app(Settings(db=str(tmp_path / "n.db"))).state
    total = BASELINE_BYTES + caps.settings.cache_bytes + caps.settings.queue_bytes
    assert total <= MEMORY_BUDGET_BYTES == 384 << 20


def test_checkpoint_files_are_capped_typed_and_read_once(tmp_path):
    root = tmp_path / "ck"
    for step in ("1", "2", "3", "4", "5"):
        (root / step).mkdir(parents=True)
    meta = json.dumps({"step": 1, "files": []})
    (root / "1" / "checkpoint_metadata.json").write_text(meta)
    with open(root / "2" / "checkpoint_metadata.json", "wb") as f:  # 400 MB, sparse
        f.truncate(400 << 20)
    os.mkfifo(root / "3" / "checkpoint_metadata.json")  # would block a plain reader for ever
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"step": 4, "files": []}))
    (root / "4" / "checkpoint_metadata.json").symlink_to(secret)  # out of the folder
    (root / "5" / "checkpoint_metadata.json").symlink_to("/dev/zero")
    found = scan_checkpoints(str(root), None)
    assert [c.step for c in found] == [1]
    # read once: a second view finds it in the cache by identity, a rewrite is read again
    hits = len(METADATA)
    assert [c.step for c in scan_checkpoints(str(root), None)] == [1]
    assert len(METADATA) == hits
    time.sleep(0.01)
    (root / "1" / "checkpoint_metadata.json").write_text(json.dumps({"step": 1, "files": [1]}))
    (again,) = scan_checkpoints(str(root), None)
    assert again.complete is False  # the new content (a malformed file entry) was read


def test_input_errors_are_4xx_without_traceback(tmp_path, caplog):
    app = create_app(Settings(db=str(tmp_path / "i.db")))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS, raise_server_exceptions=False) as c:
        for cursor in ("1_9223372036854775808", "inf_1", "nan_1", "1_-1", "x"):
            r = c.get(f"/api/runs?cursor={cursor}")
            assert r.status_code == 400 and "cursor" in r.json()["detail"], cursor
    assert "Traceback" not in caplog.text


def test_client_gone_mid_upload_is_quiet_and_secrets_never_logged(tmp_path):
    """Every log level, auth exercised every way: neither token nor a cookie value appears."""
    levels = ("critical", "error", "warning", "info", "debug", "trace")
    access = "access-token-that-must-not-be-logged"
    servers = []
    for level in levels:
        d = start_dashboard(
            tmp_path / f"{level}.db", "--allow-launch", "--log-level", level, token=access
        )
        servers.append(d)
    for d in servers:
        owner = {"Authorization": f"Bearer {LAUNCH_TOKEN}"}
        req = urllib.request.Request(f"{d.url}/api/session", headers=owner)
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["signed_in_as"] == "launch"
        with socket.create_connection(("127.0.0.1", d.port)) as s:  # login by ?token=
            s.sendall(f"GET /?token={access} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            head = s.recv(4096).decode()
        cookie = head.split("set-cookie: ", 1)[1].split(";", 1)[0]
        req = urllib.request.Request(f"{d.url}/api/runs", headers={"Cookie": cookie})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        d.post("/api/ingest", {"type": "run_start", "run_id": "r"})
        with socket.create_connection(("127.0.0.1", d.port)) as s:  # a client gone mid-upload
            s.sendall(
                b"POST /api/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                b"\r\nAuthorization: Bearer " + access.encode() + b"\r\nContent-Length: 100000"
                b"\r\n\r\n[" + b" " * 1000
            )
        d.cookie = cookie.split("=", 1)[1]
    time.sleep(0.5)
    for level, d in zip(levels, servers):
        d.stop()
        log = d.proc.stdout.read().decode()
        for secret in (access, LAUNCH_TOKEN, d.cookie):
            assert secret not in log, (level, secret)
        assert "Traceback" not in log, (level, log[-2000:])
        if level in ("debug", "trace"):
            assert "<redacted>" in log, level  # the credentials were there to redact


@pytest.mark.browser
def test_api_docs_render_offline_from_this_origin(browser, live_dashboard):
    d = live_dashboard
    ctx = browser.new_context(offline=False)
    page = ctx.new_page()
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    # offline: anything not on this origin fails, as on a cluster without internet
    page.route(
        "**/*",
        lambda route: route.continue_() if route.request.url.startswith(d.url) else route.abort(),
    )
    page.goto(d.url + "/docs")
    page.locator("section.endpoint h3", has_text="GET /api/runs").first.wait_for(timeout=10_000)
    assert page.locator("section.endpoint").count() >= 10
    assert requested and all(u.startswith(d.url + "/") for u in requested), requested
    ctx.close()
