"""Threats (security review findings 1-5): a hostile page (cross-site requests, DNS rebinding, framing), token
hygiene and launch safety. Each test asserts the refusal and that the stored run is unchanged."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from dashboard_helpers import LAUNCH_TOKEN, LOCAL, OWNER_HEADERS, WS, start_dashboard
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from nanotron_dashboard.app import Settings, create_app

EVIL = "http://evil.example"
HIJACK = {
    "type": "run_start",
    "run_id": "victim",
    "command": ["sh", "-c", "id > /tmp/pwned"],
    "cwd": "/tmp",
}


@pytest.fixture(scope="module")
def app_client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("threats")
    app = create_app(
        Settings(
            db=str(tmp / "t.db"),
            allow_launch=True,
            launch_token=LAUNCH_TOKEN,
            allowed_hosts=("dash.internal",),
        )
    )
    with TestClient(app, base_url=LOCAL, headers=OWNER_HEADERS) as c:  # the owner's browser
        r = c.post(
            "/api/ingest",
            json={
                "type": "run_start",
                "run_id": "victim",
                "command": [sys.executable, "-c", "pass"],
                "cwd": str(tmp),
            },
        )
        assert r.status_code == 200, r.text
        c.post(
            "/api/ingest",
            json={"type": "checkpoint", "run_id": "victim", "step": 5, "path": str(tmp / "5")},
        )
        c.stored = c.get("/api/runs/victim").json()  # type: ignore[attr-defined]
        yield c


def unchanged(c) -> None:
    now = c.get("/api/runs/victim").json()
    for key in ("command", "cwd", "checkpoints_path", "config", "project", "name"):
        assert now[key] == c.stored[key], key


def test_finding1_cross_site_ingest_is_refused(app_client):
    c = app_client
    body = json.dumps(HIJACK)
    # the exact probe: a "simple" cross-site request (text/plain, foreign Origin)
    r = c.post("/api/ingest", content=body, headers={"Origin": EVIL, "Content-Type": "text/plain"})
    assert r.status_code == 403 and "cross-origin" in r.json()["detail"]
    # without the Origin (a non-browser client), text/plain is still not ingest
    r = c.post("/api/ingest", content=body, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    # a form post's encoding neither
    r = c.post(
        "/api/ingest", content=b"a=b", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 415
    # a hostile trainer (JSON, no Origin): the command is fixed by the first run_start
    r = c.post("/api/ingest", json=HIJACK)
    assert r.status_code == 409 and "fixed by its first run_start" in r.json()["errors"][0]["error"]
    unchanged(c)
    # ... and over the websocket: an error frame, and the connection stays open
    with c.websocket_connect(WS + "/ws/ingest") as ws:
        ws.send_json(HIJACK)
        reply = ws.receive_json()
        assert reply["ok"] is False and reply["status"] == 409
        same = {k: c.stored[k] for k in ("command", "cwd", "checkpoints_path")}
        ws.send_json({"type": "run_start", "run_id": "victim", **same})  # a replay: fine
        assert ws.receive_json()["ok"] is True
    unchanged(c)


def test_finding2_dns_rebinding_host_is_refused(app_client):
    c = app_client
    rebind = {"Host": "rebind.evil.example:8008"}
    r = c.get("/api/session", headers=rebind)
    assert r.status_code == 421 and "csrf" not in r.text and "--allowed-host" in r.json()["detail"]
    ck = c.get("/api/runs/victim/checkpoints").json()[0]["id"]
    r = c.post(
        f"/api/checkpoints/{ck}/resume",
        headers={**rebind, "Origin": "http://rebind.evil.example:8008", "X-CSRF-Token": "x"},
    )
    assert r.status_code == 421
    assert c.get("/api/runs", headers={"Host": ""}).status_code == 400
    assert c.get("/api/runs", headers={"Host": "a b:1"}).status_code == 400
    # served: loopback names, the bound host, and --allowed-host names
    for host in (
        "127.0.0.1:8008",
        "localhost:8008",
        "[::1]:8008",
        "dash.internal:8008",
        "LOCALHOST",
    ):
        assert c.get("/api/runs", headers={"Host": host}).status_code == 200, host
    with (
        pytest.raises(WebSocketDisconnect),
        c.websocket_connect("ws://rebind.evil.example:8008/ws/runs/victim") as ws,
    ):
        ws.receive_text()
    # the session's CSRF token only to our own pages: not to another site's page
    assert c.get("/api/session", headers={"Origin": EVIL}).status_code == 403
    assert c.get("/api/session", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert c.get("/api/session", headers={"Sec-Fetch-Site": "same-site"}).status_code == 403
    assert c.get("/api/session", headers={"Sec-Fetch-Site": "same-origin"}).json()["csrf"]
    unchanged(c)


def test_finding3_framing_headers_and_websocket_origin(app_client):
    c = app_client
    for path in ("/", "/runs/victim", "/api/runs", "/static/run.js"):
        h = c.get(path).headers
        assert h["x-frame-options"] == "DENY", path
        assert "frame-ancestors 'none'" in h["content-security-policy"], path
        assert "default-src 'self'" in h["content-security-policy"], path
        assert h["cross-origin-resource-policy"] == "same-origin"
    for path in ("/ws/ingest", "/ws/runs", "/ws/runs/victim"):
        with (
            pytest.raises(WebSocketDisconnect) as e,
            c.websocket_connect(WS + path, headers={"Origin": EVIL}) as ws,
        ):
            ws.receive_text()
        assert e.value.code == 1008
    with c.websocket_connect(WS + "/ws/ingest", headers={"Origin": LOCAL}) as ws:  # our own
        ws.send_json({"type": "heartbeat", "run_id": "victim", "ack": 1})
        assert ws.receive_json()["ack"] == 1
    unchanged(c)


def test_finding4_csrf_header_and_redirect(app_client, tmp_path):
    c = app_client
    ck = c.get("/api/runs/victim/checkpoints").json()[0]["id"]
    r = c.post(
        f"/api/checkpoints/{ck}/resume",
        headers={"X-CSRF-Token": "\u00e9\u00e8".encode()},
    )
    assert r.status_code == 403
    tok = 'a b;c=d,"e\u00e9'
    app = create_app(Settings(db=str(tmp_path / "tok.db"), token=tok))
    with TestClient(app, base_url=LOCAL) as t:
        from urllib.parse import quote

        r = t.get("/runs/x?token=" + quote(tok) + "&a=1", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/runs/x?a=1"
        assert tok not in r.headers["set-cookie"]  # the cookie holds an HMAC, not the token
        assert t.get("/api/runs").status_code == 200  # ... and it works with `;` and spaces
        t.cookies.clear()
        assert t.get("/api/runs").status_code == 401
        bearer = {"Authorization": b"Bearer " + tok.encode()}
        assert t.get("/api/runs", headers=bearer).status_code == 200


def test_finding4_token_sources_and_no_token_in_logs(tmp_path, monkeypatch):
    from nanotron_dashboard.cli import main, parse_args, resolve_token

    bad = tmp_path / "bad.txt"
    bad.write_text("  \n")
    assert main(["--db", str(tmp_path / "x.db"), "--token-file", str(bad)]) == 2
    monkeypatch.setenv("NANOTRON_DASHBOARD_TOKEN", "")
    assert main(["--db", str(tmp_path / "x.db")]) == 2
    tok = "s3cret-token-for-the-log-test"
    token_file = tmp_path / "token"
    token_file.write_text(tok + "\n")
    monkeypatch.delenv("NANOTRON_DASHBOARD_TOKEN")
    assert resolve_token(parse_args(["--token-file", str(token_file)])) == tok
    assert resolve_token(parse_args([])) is None
    # one real server, token from the environment (the file gives the same string)
    for how, extra, env in (("env", [], {"NANOTRON_DASHBOARD_TOKEN": tok}),):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        d = start_dashboard(tmp_path / f"{how}.db", "--log-level", "info", *extra, token=None)
        try:
            with open(f"/proc/{d.proc.pid}/cmdline", "rb") as f:
                assert tok.encode() not in f.read()  # not in the process list
            for path in ("/?token=" + tok, "/api/runs?token=" + tok):
                try:  # 303 to the same URL without the token (urllib keeps no cookie: 401)
                    urllib.request.urlopen(d.url + path, timeout=10).read()
                except urllib.error.HTTPError as e:
                    assert e.code == 401
            # the login redirect stays on the site, whatever the path looks like
            for raw in ("//evil.example/x", "/\\evil.example/x", "///evil.example"):
                conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
                conn.request("GET", f"{raw}?token={tok}")
                resp = conn.getresponse()
                location = resp.getheader("location")
                conn.close()
                assert resp.status == 303 and location.startswith("/"), (raw, location)
                assert not location.startswith(("//", "/\\")), (raw, location)
            req = urllib.request.Request(d.url + "/api/runs")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401
            req.add_header("Authorization", f"Bearer {tok}")
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200
        finally:
            d.stop()
        log = d.proc.stdout.read().decode()
        assert "GET /api/runs?token=<redacted>" in log, log  # the access log ran, redacted
        assert tok not in log, log
        assert f"at {d.url}/ (token required" in log.splitlines()[0]


def test_finding5_parallel_launches_start_one_child_and_reap_it(live_dashboard, tmp_path):
    d = live_dashboard
    marker = tmp_path / "starts"
    script = tmp_path / "slow.py"
    release = tmp_path / "release"
    script.write_text(  # runs until the test releases it: the launches overlap for sure
        "import os, time\n"
        f"open({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "t0 = time.time()\n"
        f"while not os.path.exists({str(release)!r}) and time.time() - t0 < 120:\n"
        "    time.sleep(0.05)\n"
    )
    d.post(
        "/api/ingest",
        {
            "type": "run_start",
            "run_id": "dedup",
            "cwd": str(tmp_path),
            "checkpoints_path": "ck",
            "command": [sys.executable, str(script)],
        },
        token=LAUNCH_TOKEN,
    )
    d.post("/api/ingest", {"type": "checkpoint", "run_id": "dedup", "step": 1, "path": "ck/1"})
    ck = d.get("/api/runs/dedup/checkpoints")[0]["id"]
    owner = {"Authorization": f"Bearer {LAUNCH_TOKEN}"}
    with urllib.request.urlopen(
        urllib.request.Request(d.url + "/api/session", headers=owner), timeout=10
    ) as r:
        csrf = json.loads(r.read())["csrf"]
    codes: list[int] = []

    def post() -> None:
        req = urllib.request.Request(
            f"{d.url}/api/checkpoints/{ck}/resume",
            method="POST",
            headers={"X-CSRF-Token": csrf, **owner},
        )
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                codes.append(r.status)
        except urllib.error.HTTPError as e:
            codes.append(e.code)

    threads = [threading.Thread(target=post) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [202, 409, 409]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (marker.exists() and marker.read_text()):
        time.sleep(0.05)
    (pid,) = [int(p) for p in marker.read_text().split()]
    release.write_text("")
    # after it exits it is reaped: no zombie left under the server
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), Path(f"/proc/{pid}/stat").read_text()
    post()  # the previous launch ended: a new one may start
    assert codes[-1] == 202
