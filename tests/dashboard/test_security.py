"""Binding, tokens, launch protection and bad startup input."""

from __future__ import annotations

import json
import sqlite3
import sys
import time

import pytest
from dashboard_helpers import JSON_HEADERS, LAUNCH_TOKEN, LOCAL, WS
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from nanotron_dashboard import app as app_module
from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.cli import main
from nanotron_dashboard.errors import MissingAssetError


def test_non_loopback_host_needs_a_token(tmp_path, capsys):
    assert main(["--db", str(tmp_path / "a.db"), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0" in err and "--token" in err and "Traceback" not in err


def test_malformed_database_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite at all" * 100)
    assert main(["--db", str(bad)]) == 2
    assert "not an SQLite database" in capsys.readouterr().err
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE foo(x)")
    assert main(["--db", str(other)]) == 2
    assert "not a nanotron dashboard database" in capsys.readouterr().err
    truncated = tmp_path / "trunc.db"
    truncated.write_bytes(b"SQLite format 3\x00" + b"\x01" * 200)
    assert main(["--db", str(truncated)]) == 2
    assert f"--db {truncated}" in capsys.readouterr().err


def test_missing_chart_asset_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(app_module, "VENDOR", tmp_path / "no-vendor")
    with pytest.raises(MissingAssetError, match="reinstall nanotron-dashboard"):
        create_app(Settings(db=str(tmp_path / "x.db")))


def test_token_guards_api_pages_and_ingest(tmp_path):
    app = create_app(Settings(db=str(tmp_path / "t.db"), token="tok"))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as c:
        for path in ("/", "/runs/x", "/api/runs", "/docs", "/static/vendor/uPlot.iife.min.js"):
            assert c.get(path).status_code == 401, path
        assert c.post("/api/ingest", json={"type": "heartbeat", "run_id": "r"}).status_code == 401
        with pytest.raises(WebSocketDisconnect), c.websocket_connect(WS + "/ws/ingest") as ws:
            ws.receive_text()
        with pytest.raises(WebSocketDisconnect), c.websocket_connect(WS + "/ws/runs/x") as ws:
            ws.receive_text()
        assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer tok"}).json() == []
        r = c.get("/?token=tok&x=1", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/?x=1"
        assert "HttpOnly" in r.headers["set-cookie"]
        assert c.get("/api/runs").status_code == 200  # the cookie now authenticates the browser
        with c.websocket_connect(WS + "/ws/runs") as ws:
            c.post("/api/ingest", json={"type": "run_start", "run_id": "r"})
            assert ws.receive_json() == {"type": "runs_changed", "ids": ["r"]}


def _with_checkpoint(c, tmp_path, command, headers=None):
    """A run (started by a trainer holding the launch token when `headers` carry it) and one
    checkpoint inside its checkpoints path; the checkpoint's id."""
    start = {"type": "run_start", "run_id": "parent", "command": command, "cwd": str(tmp_path)}
    c.post("/api/ingest", json={**start, "checkpoints_path": "ck"}, headers=headers)
    c.post(
        "/api/ingest",
        json={
            "type": "checkpoint",
            "run_id": "parent",
            "step": 5,
            "path": str(tmp_path / "ck" / "5"),
        },
    )
    return c.get("/api/runs/parent/checkpoints").json()[0]["id"]


def test_launch_is_off_by_default_and_csrf_protected(tmp_path):
    with TestClient(
        create_app(Settings(db=str(tmp_path / "a.db"))), base_url=LOCAL, headers=JSON_HEADERS
    ) as c:
        ck = _with_checkpoint(c, tmp_path, ["true"])
        session = c.get("/api/session").json()
        assert session["allow_launch"] is False
        r = c.post(f"/api/checkpoints/{ck}/resume", headers={"X-CSRF-Token": session["csrf"]})
        assert r.status_code == 403 and "--allow-launch" in r.json()["detail"]
    with TestClient(
        create_app(Settings(db=str(tmp_path / "b.db"), allow_launch=True, launch_token="L")),
        base_url=LOCAL,
        headers={**JSON_HEADERS, "Authorization": "Bearer L"},
    ) as c:
        ck = _with_checkpoint(c, tmp_path, ["true"])
        csrf = c.get("/api/session").json()["csrf"]
        assert c.post(f"/api/checkpoints/{ck}/resume").status_code == 403
        assert (
            c.post(f"/api/checkpoints/{ck}/resume", headers={"X-CSRF-Token": "guess"}).status_code
            == 403
        )
        evil = {"X-CSRF-Token": csrf, "Origin": "http://evil.example"}
        assert c.post(f"/api/checkpoints/{ck}/resume", headers=evil).status_code == 403
        assert (
            c.post("/api/checkpoints/999/resume", headers={"X-CSRF-Token": csrf}).status_code == 404
        )
        # the request names a checkpoint id only: a path or command in it is not even read
        r = c.post(
            f"/api/checkpoints/{ck}/resume",
            headers={"X-CSRF-Token": csrf},
            json={"command": ["rm", "-rf", "/"], "path": "/etc"},
        )
        assert r.status_code == 202 and r.json()["argv"] == [
            "true",
            "--resume",
            str(tmp_path / "ck" / "5"),
        ]


def test_resume_launch_runs_stored_command_and_links_parent(live_dashboard, tmp_path):
    """A real launch: the stored command starts in the stored cwd and reports the new run."""
    script = tmp_path / "fake_train.py"
    script.write_text(
        "import json, os, sys, urllib.request\n"
        "resume = sys.argv[sys.argv.index('--resume') + 1]\n"
        "msg = {'type': 'run_start', 'run_id': 'child-' + os.path.basename(resume), 'command': sys.argv,"
        " 'cwd': os.getcwd()}\n"
        "req = urllib.request.Request(os.environ['NANOTRON_DASHBOARD_URL'] + '/api/ingest',"
        " data=json.dumps(msg).encode(), method='POST',"
        " headers={'Content-Type': 'application/json'})\n"
        "urllib.request.urlopen(req, timeout=10).read()\n"
        "open('launched.txt', 'w').write(os.getcwd())\n"
    )
    d = live_dashboard
    d.post(
        "/api/ingest",
        {
            "type": "run_start",
            "run_id": "launch-parent",
            "cwd": str(tmp_path),
            "checkpoints_path": "ck",
            "command": [sys.executable, "fake_train.py", "--resume", "old"],
        },
        token=LAUNCH_TOKEN,  # the owner's trainer: its command may be launched
    )
    d.post(
        "/api/ingest", {"type": "checkpoint", "run_id": "launch-parent", "step": 7, "path": "ck/7"}
    )
    ck = d.get("/api/runs/launch-parent/checkpoints")[0]
    assert ck["resume_command"].endswith("fake_train.py --resume ck/7")
    import urllib.request

    owner = {"Authorization": f"Bearer {LAUNCH_TOKEN}"}
    with urllib.request.urlopen(
        urllib.request.Request(f"{d.url}/api/session", headers=owner), timeout=10
    ) as r:
        csrf = json.loads(r.read())["csrf"]
    req = urllib.request.Request(
        f"{d.url}/api/checkpoints/{ck['id']}/resume",
        method="POST",
        headers={"X-CSRF-Token": csrf, "Origin": d.url, **owner},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 202 and json.loads(r.read())["cwd"] == str(tmp_path)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (tmp_path / "launched.txt").exists():
        time.sleep(0.1)
    assert (tmp_path / "launched.txt").read_text() == str(tmp_path)
    assert d.get("/api/runs/child-7")["resumed_from"] == {"run_id": "launch-parent", "step": 7}
