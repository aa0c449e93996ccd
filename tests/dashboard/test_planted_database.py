"""A database another user could write: planted before the first start in a shared folder,
or rewritten behind the server's back (issue 44, findings 1 and 11).

The other user is a real other uid (`nobody`; the tests run as root) working in a folder
like /tmp (mode 1777: anyone creates files, nobody removes another's).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
import uvicorn
from dashboard_helpers import LAUNCH_TOKEN, LOCAL, OWNER_HEADERS, run_as_nobody
from fastapi.testclient import TestClient

from nanotron_dashboard.app import Settings, create_app, launch_log_dir
from nanotron_dashboard.cli import main

# runs as `nobody`: `file:PATH` creates PATH mode 0666, `dir:PATH` a folder 0777,
# `link:PATH` a symlink to /tmp/elsewhere
PLANT = r"""
import os, sys
for item in sys.argv[1:]:
    kind, path = item.split(":", 1)
    if kind == "file":
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o666)
        os.fchmod(fd, 0o666)
        os.close(fd)
    elif kind == "dir":
        os.mkdir(path)
        os.chmod(path, 0o777)
    else:
        os.symlink("/tmp/elsewhere", path)
"""


@pytest.fixture
def shared():
    """A folder like /tmp, in the system's temporary folder (pytest's are not reachable by
    other users): world-writable and sticky."""
    folder = Path(tempfile.mkdtemp(prefix="nanotron-shared-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder)


def _start(argv, monkeypatch, capsys):
    """main(argv)'s exit code and stderr; a server that would serve returns 0 instead."""
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    monkeypatch.setenv("NANOTRON_DASHBOARD_LAUNCH_TOKEN", LAUNCH_TOKEN)
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("planted", "named", "why"),
    [
        (("file:runs.db", "file:runs.db-wal", "file:runs.db-shm"), "runs.db", "another user"),
        (("file:runs.db-wal",), "runs.db-wal", "another user"),
        (("file:runs.db-shm",), "runs.db-shm", "another user"),
        (("link:runs.db-wal",), "runs.db-wal", "symlink"),
        (("file:runs.db-journal",), "runs.db-journal", "another user"),
        (("link:runs.db",), "runs.db", "symlink made by another user"),
        (("dir:runs.db.launches",), "runs.db.launches", "another user"),
    ],
)
def test_files_another_user_created_first_refuse_the_start(
    shared, planted, named, why, monkeypatch, capsys
):
    """Another user creates the database, a side file or the launch logs' folder before
    the owner's first start: the server refuses, in one line naming the file, exit 2."""
    run_as_nobody(PLANT, *(f"{k}:{shared / n}" for k, n in (p.split(":") for p in planted)))
    code, err = _start(["--db", str(shared / "runs.db"), "--allow-launch"], monkeypatch, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{shared / named} " in err or f"{shared / named}:" in err, err
    assert why in err, err
    for item in planted:  # SQLite never wrote into what the other user planted
        path = shared / item.split(":")[1]
        if item.startswith("file:"):
            assert path.stat().st_size == 0, path


def test_loose_modes_and_folders_refuse_the_start(tmp_path, monkeypatch, capsys):
    db = tmp_path / "mine.db"
    with TestClient(create_app(Settings(db=str(db))), base_url=LOCAL):
        pass  # a fine database, then made writable by all
    db.chmod(0o666)
    code, err = _start(["--db", str(db)], monkeypatch, capsys)
    assert code == 2 and "writable by other users (mode 666)" in err and "chmod 600" in err
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)  # anyone could rename the file away and put another there
    code, err = _start(["--db", str(open_folder / "runs.db")], monkeypatch, capsys)
    assert code == 2 and "no sticky bit" in err and err.count("\n") == 1, err
    team = tmp_path / "team"  # writable by a group others are in: they could too
    team.mkdir()
    os.chown(team, -1, pwd.getpwnam("nobody").pw_gid)
    team.chmod(0o770)
    code, err = _start(["--db", str(team / "runs.db")], monkeypatch, capsys)
    assert code == 2 and "no sticky bit" in err, err
    umask_002 = tmp_path / "mine"  # writable by the user's private group only: fine
    umask_002.mkdir()
    umask_002.chmod(0o775)
    with TestClient(create_app(Settings(db=str(umask_002 / "runs.db"))), base_url=LOCAL):
        pass


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_database_files_and_launch_logs_are_private(shared, tmp_path):
    """In a shared folder, a new database and its WAL and shared-memory files are 0600, the
    launch logs' folder 0700 (an existing one of ours is tightened) and each log 0600."""
    db = shared / "runs.db"
    old_logs = tmp_path / "old.db.launches"  # as an earlier release left it
    old_logs.mkdir(mode=0o755)
    old_logs.chmod(0o755)
    for path in (db, tmp_path / "old.db"):
        settings = Settings(db=str(path), launch_token=LAUNCH_TOKEN, allow_launch=True)
        with TestClient(create_app(settings), base_url=LOCAL, headers=OWNER_HEADERS) as c:
            for suffix in ("", "-wal", "-shm"):
                assert _mode(f"{path}{suffix}") == 0o600, suffix
            logs = launch_log_dir(str(path))
            assert _mode(logs) == 0o700
            ck = _granted_checkpoint(c, "r", tmp_path)
            r = _resume(c, ck)
            assert r.status_code == 202, r.text
            assert _mode(r.json()["log"]) == 0o600


def _granted_checkpoint(c, run_id, cwd) -> int:
    """A run started by the owner's trainer (the launch token): granted; its checkpoint id."""
    start = {"type": "run_start", "run_id": run_id, "command": ["true"], "cwd": str(cwd)}
    assert c.post("/api/ingest", json={**start, "checkpoints_path": "ck"}).status_code == 200
    ck = {"type": "checkpoint", "run_id": run_id, "step": 1, "path": "ck/1"}
    assert c.post("/api/ingest", json=ck).status_code == 200
    return c.get(f"/api/runs/{run_id}/checkpoints").json()[0]["id"]


def _resume(c, checkpoint_id):
    csrf = c.get("/api/session").json()["csrf"]
    return c.post(f"/api/checkpoints/{checkpoint_id}/resume", headers={"X-CSRF-Token": csrf})


# what another writer of the database does, directly in SQL, to each run
REWRITES = {
    "grant": ("UPDATE launch_grants SET command=:evil WHERE run_pk=:pk",),
    "run": ("UPDATE runs SET command=:evil WHERE pk=:pk",),
    "both": (
        "UPDATE launch_grants SET command=:evil WHERE run_pk=:pk",
        "UPDATE runs SET command=:evil WHERE pk=:pk",
    ),
    "cwd": ("UPDATE launch_grants SET cwd='/' WHERE run_pk=:pk",),
    "unsigned": ("UPDATE launch_grants SET mac=NULL WHERE run_pk=:pk",),
}


def test_a_grant_rewritten_in_the_database_is_not_launched(db_url, tmp_path, monkeypatch, caplog):
    """A command, cwd or signature changed in the database behind the server's back (a
    planted file, a PostgreSQL role with write access): Resume refuses (403, one log line
    each) and nothing runs; an untouched grant still launches."""
    from sqlalchemy import text

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # PostgreSQL's launch logs
    marker = tmp_path / "pwned"
    evil = json.dumps(["sh", "-c", f"touch {marker}"])
    settings = Settings(db=db_url, launch_token=LAUNCH_TOKEN, allow_launch=True)
    with TestClient(create_app(settings), base_url=LOCAL, headers=OWNER_HEADERS) as c:
        ids = {run: _granted_checkpoint(c, run, tmp_path) for run in (*REWRITES, "kept")}
        with c.app.state.engine.begin() as conn:
            for run, statements in REWRITES.items():
                pk = conn.execute(text("SELECT pk FROM runs WHERE id=:id"), {"id": run}).scalar()
                for sql in statements:
                    conn.execute(text(sql), {"evil": evil, "pk": pk})
        with caplog.at_level(logging.ERROR, logger="nanotron_dashboard"):
            for run in REWRITES:
                r = _resume(c, ids[run])
                assert r.status_code == 403, (run, r.text)
                assert "outside the dashboard" in r.json()["detail"], (run, r.text)
        kept = _resume(c, ids["kept"])
        assert kept.status_code == 202, kept.text
        log = kept.json()["log"]  # beside the file, or under ~/.cache for PostgreSQL
        assert _mode(log) == 0o600 and _mode(os.path.dirname(log)) == 0o700
    refusals = [r for r in caplog.records if "refused to launch" in r.getMessage()]
    assert len(refusals) == len(REWRITES)
    time.sleep(0.5)
    assert not marker.exists()
