"""Another user of the same machine (a cluster login node): loopback is not a user boundary.

The attacker is a real other uid (`nobody`, the tests run as root), talking to a real server.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from dashboard_helpers import (
    JSON_HEADERS,
    LAUNCH_TOKEN,
    LOCAL,
    OWNER_HEADERS,
    run_as_nobody,
    start_dashboard,
)
from fastapi.testclient import TestClient

from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.auth import ACCESS, ANON, OWNER, CookieSigner
from nanotron_dashboard.cli import main

# runs as `nobody`: run_start + checkpoint, the CSRF token from /api/session, then Resume
ATTACK = r"""
import json, sys, urllib.request, urllib.error
url, marker, token = sys.argv[1], sys.argv[2], sys.argv[3] or None
def call(path, body=None, headers=None, method=None):
    h = {"content-type": "application/json", **(headers or {})}
    if token:
        h["Authorization"] = "Bearer " + token
    req = urllib.request.Request(url + path, json.dumps(body).encode() if body is not None
                                 else None, h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
out = {}
cmd = ["sh", "-c", "id > " + marker]
out["start"] = call("/api/ingest", {"type": "run_start", "run_id": "evil", "command": cmd,
                                    "cwd": "/tmp", "checkpoints_path": "/tmp"})[0]
call("/api/ingest", {"type": "checkpoint", "run_id": "evil", "step": 1, "path": "/tmp/1"})
out["session"] = call("/api/session")[1]
cks = call("/api/runs/evil/checkpoints")[1]
ck = cks[0]["id"] if isinstance(cks, list) and cks else 1
csrf = (out["session"] or {}).get("csrf") or "guess"
for i in (ck, 1, 2):
    out.setdefault("resume", []).append(
        call(f"/api/checkpoints/{i}/resume", {}, {"X-CSRF-Token": csrf}, "POST")[0])
print(json.dumps(out))
"""


def as_nobody(*argv: str) -> dict:
    return json.loads(run_as_nobody(ATTACK, *argv))


@pytest.mark.parametrize("with_access_token", [False, True])
def test_another_local_user_cannot_launch(tmp_path, with_access_token):
    """`nobody` posts a command, a checkpoint, asks for the CSRF token and resumes: refused,
    with no token and with the trainers' access token alike; nothing runs."""
    marker = tmp_path / "pwned"
    tmp_path.chmod(0o1777)  # as /tmp: the attacker could write its marker, only a launch would
    access = "trainer-access-token" if with_access_token else None
    d = start_dashboard(tmp_path / "runs.db", "--allow-launch", token=access)
    try:
        out = as_nobody(d.url, str(marker), access or "")
    finally:
        d.stop()
    assert out["start"] == 200  # streaming stays open to trainers (with the access token)
    assert out["session"]["allow_launch"] is False
    if with_access_token:  # a trainer's credential: signed in, but it cannot launch
        assert out["session"]["signed_in_as"] == "access" and out["resume"] == [403] * 3
    else:  # no credential: not even the CSRF token
        assert out["session"]["csrf"] is None and out["resume"] == [401] * 3
    time.sleep(0.5)
    assert not marker.exists()


def test_allow_launch_needs_its_own_private_token(tmp_path, capsys, monkeypatch):
    db = str(tmp_path / "a.db")
    monkeypatch.delenv("NANOTRON_DASHBOARD_LAUNCH_TOKEN", raising=False)
    monkeypatch.delenv("NANOTRON_DASHBOARD_TOKEN", raising=False)
    assert main(["--db", db, "--allow-launch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--launch-token-file" in err and "Traceback" not in err
    loose = tmp_path / "launch"
    loose.write_text("L\n")
    loose.chmod(0o644)
    assert main(["--db", db, "--allow-launch", "--launch-token-file", str(loose)]) == 2
    assert "chmod 600" in capsys.readouterr().err
    loose.chmod(0o600)
    assert (
        main(["--db", db, "--allow-launch", "--launch-token-file", str(loose), "--token", "L"]) == 2
    )
    assert "equals the access token" in capsys.readouterr().err


def test_only_commands_sent_with_the_launch_token_run(tmp_path):
    """The access token streams but does not launch; a run_start without the launch token
    grants nothing; a checkpoint outside the granted checkpoints path is refused."""
    settings = Settings(
        db=str(tmp_path / "g.db"), token="A", launch_token=LAUNCH_TOKEN, allow_launch=True
    )
    access = {**JSON_HEADERS, "Authorization": "Bearer A"}
    with TestClient(create_app(settings), base_url=LOCAL, headers=OWNER_HEADERS) as c:
        base = {
            "type": "run_start",
            "command": ["true"],
            "cwd": str(tmp_path),
            "checkpoints_path": "ck",
        }
        c.post("/api/ingest", json={**base, "run_id": "mine"})
        c.post("/api/ingest", json={**base, "run_id": "theirs"}, headers=access)
        for step, (run, path) in enumerate(
            (("mine", "ck/1"), ("mine", "/etc"), ("theirs", "ck/1"))
        ):
            body = {"type": "checkpoint", "run_id": run, "step": step, "path": path}
            c.post("/api/ingest", json=body, headers=access)
        ids = {
            (r, ck["path"]): ck["id"]
            for r in ("mine", "theirs")
            for ck in c.get(f"/api/runs/{r}/checkpoints").json()
        }
        csrf = c.get("/api/session").json()["csrf"]
        assert c.get("/api/session", headers=access).json()["allow_launch"] is False

        def post(i, h=None):
            headers = {"X-CSRF-Token": csrf, **(h or {})}
            return c.post(f"/api/checkpoints/{i}/resume", headers=headers)

        assert post(ids["mine", "ck/1"], access).status_code == 403  # the trainer credential
        assert "launch token" in post(ids["theirs", "ck/1"]).json()["detail"]
        assert "not inside" in post(ids["mine", "/etc"]).json()["detail"]
        r = post(ids["mine", "ck/1"])
        assert r.status_code == 202 and r.json()["argv"] == ["true", "--resume", "ck/1"]
        # a later run_start from someone else cannot change what the grant runs
        hijack = {**base, "run_id": "mine", "command": ["sh", "-c", "id"]}
        assert c.post("/api/ingest", json=hijack, headers=access).status_code == 409
        c.delete("/api/runs/mine", headers={"X-CSRF-Token": csrf})
        grants = c.app.state.writer.submit(
            lambda conn: conn.exec_driver_sql("SELECT COUNT(*) FROM launch_grants").scalar(),
            want_result=True,
        ).result()
        assert grants == 0


def test_login_cookie_is_per_server_expiring_and_rotated(tmp_path):
    signer = CookieSigner(8008)
    value = signer.issue(OWNER, now=1000.0).encode()
    assert signer.check(value, now=1001.0) == (OWNER, False)
    assert signer.check(value, now=1000.0 + signer.max_age_s * 0.6) == (OWNER, True)  # renew
    assert signer.check(value, now=1000.0 + signer.max_age_s + 1)[0] == ANON  # expired
    assert CookieSigner(8009).check(value, now=1001.0)[0] == ANON  # another port
    assert CookieSigner(8008).check(value, now=1001.0)[0] == ANON  # another start
    forged = value.replace(b"2.", b"1.", 1)
    assert signer.check(forged, now=1001.0)[0] == ANON
    settings = Settings(db=str(tmp_path / "c.db"), token="A", port=8008)
    with TestClient(create_app(settings), base_url=LOCAL) as c:
        r = c.get("/?token=A", follow_redirects=False)
        cookie = r.headers["set-cookie"]
        assert cookie.startswith("nanotron_dashboard_8008=1.") and "Max-Age=28800" in cookie
        assert "A" not in cookie.split(";")[0].split("=", 1)[1].split(".")[2]
        assert c.get("/api/session").json()["signed_in_as"] == "access"
        stale = c.app.state.cookies.issue(ACCESS, now=time.time() - 0.6 * 28800)
        c.cookies.clear()
        c.cookies.set("nanotron_dashboard_8008", stale)
        r = c.get("/api/runs")
        assert r.status_code == 200 and r.headers["set-cookie"].startswith(
            "nanotron_dashboard_8008="
        )
    # the same cookie replayed to the restarted server (a new secret): refused
    with TestClient(create_app(settings), base_url=LOCAL) as c:
        c.cookies.set("nanotron_dashboard_8008", stale)
        assert c.get("/api/runs").status_code == 401


def test_one_server_per_database_file_whatever_the_path(tmp_path):
    from nanotron_dashboard.db import lock_database
    from nanotron_dashboard.errors import DatabaseFileError

    db = tmp_path / "runs.db"
    held = lock_database(db)
    try:
        (tmp_path / "sym.db").symlink_to(db)
        os.link(db, tmp_path / "hard.db")
        for other in ("sym.db", "hard.db", "x/../runs.db"):
            (tmp_path / "x").mkdir(exist_ok=True)
            with pytest.raises(DatabaseFileError, match="another nanotron-dashboard"):
                lock_database(tmp_path / other)
    finally:
        held.close()
    assert (db.stat().st_mode & 0o777) == 0o600  # a new database: its owner's only
    lock_database(tmp_path / "hard.db").close()  # free again


def test_api_docs_are_local(tmp_path):
    with TestClient(create_app(Settings(db=str(tmp_path / "d.db"))), base_url=LOCAL) as c:
        page = c.get("/docs")
        assert page.status_code == 200 and "cdn" not in page.text.lower()
        assert "http" not in page.text.replace("http-equiv", "")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert c.get("/redoc").status_code == 404
        assert "/api/runs" in c.get("/openapi.json").json()["paths"]
