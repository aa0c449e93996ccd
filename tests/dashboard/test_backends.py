"""SQLite and PostgreSQL behind one schema: a database of the previous release (schema 2)
upgrades in place, one server per database, 64-bit steps, and a bad URL is one line."""

from __future__ import annotations

import pytest
import telemetry_data as td
from dashboard_helpers import JSON_HEADERS, LOCAL
from fastapi.testclient import TestClient
from sqlalchemy import inspect, text

from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.cli import main
from nanotron_dashboard.db import SCHEMA_VERSION, lock_database, open_database
from nanotron_dashboard.errors import DatabaseFileError


def post(c, msg):
    r = c.post("/api/ingest", json=msg)
    assert r.status_code == 200, r.text
    return r.json()


def as_schema_2(db: str) -> None:
    """Make a database look like one a previous release wrote: no timelines.clock, no
    resolved-path keys, no grant MACs."""
    engine = open_database(db)
    with engine.begin() as c:
        c.execute(text("ALTER TABLE timelines DROP COLUMN clock"))
        c.execute(text("DROP INDEX ix_checkpoints_path_key"))
        c.execute(text("DROP INDEX ix_runs_checkpoints_key"))
        c.execute(text("ALTER TABLE checkpoints DROP COLUMN path_key"))
        c.execute(text("ALTER TABLE runs DROP COLUMN checkpoints_key"))
        c.execute(text("ALTER TABLE launch_grants DROP COLUMN mac"))
        c.execute(text("UPDATE meta SET value='2' WHERE key='schema_version'"))
    engine.dispose()


def test_a_previous_release_database_upgrades_in_place(db_url):
    big = 2**40  # a step past 32 bits: PostgreSQL's columns are BIGINT where SQLite's INTEGER
    with TestClient(create_app(Settings(db=db_url)), base_url=LOCAL, headers=JSON_HEADERS) as s:
        post(s, {"type": "run_start", "run_id": "old"})
        post(s, {"type": "metrics", "run_id": "old", "step": 3, "values": {"lm_loss": 2.5}})
        post(s, {"type": "checkpoint", "run_id": "old", "step": 3, "path": "/nowhere/old/3"})
    as_schema_2(db_url)
    engine = open_database(db_url)
    with engine.begin() as c:
        cols = {col["name"] for col in inspect(c).get_columns("timelines")}
        version = c.execute(text("SELECT value FROM meta WHERE key='schema_version'")).scalar()
    engine.dispose()
    assert SCHEMA_VERSION == 5 and version == "5" and "clock" in cols
    with TestClient(create_app(Settings(db=db_url)), base_url=LOCAL, headers=JSON_HEADERS) as s:
        assert s.get("/api/runs/old/metrics?names=lm_loss").json()["series"]["lm_loss"]["y"] == [
            2.5
        ]
        post(s, td.timeline("old", 4))
        post(s, {"type": "metrics", "run_id": "old", "step": big, "values": {"lm_loss": 1.5}})
        assert s.get("/api/runs/old/timelines").json()[0]["step"] == 4
        series = s.get("/api/runs/old/metrics?names=lm_loss").json()["series"]["lm_loss"]
        assert series["step"] == [3, big] and series["y"] == [2.5, 1.5]
        assert s.get("/api/runs/old").json()["step"] == big
        # the stored checkpoint got its resolved-path key: a resume of it links to "old"
        resume = ["train", "--resume", "/nowhere/old/3"]
        post(s, {"type": "run_start", "run_id": "new", "command": resume, "cwd": "/"})
        assert s.get("/api/runs/new").json()["resumed_from"] == {"run_id": "old", "step": 3}


def test_a_nul_in_a_run_end_error_is_stored_on_both(db_url):
    with TestClient(create_app(Settings(db=db_url)), base_url=LOCAL, headers=JSON_HEADERS) as s:
        post(s, {"type": "run_start", "run_id": "nul"})
        end = {"type": "run_end", "run_id": "nul", "status": "failed", "error": "bad\x00byte"}
        post(s, end)
        run = s.get("/api/runs/nul").json()
    assert run["status"] == "failed" and run["error"] == "bad\ufffdbyte"


def test_one_server_per_database(db_url):
    lock = lock_database(db_url)
    try:
        with pytest.raises(DatabaseFileError, match="another nanotron-dashboard is serving"):
            lock_database(db_url)
    finally:
        lock.close()
    lock_database(db_url).close()  # free again once the first one let go


def test_an_unreachable_server_is_one_line_without_the_password(capsys):
    url = "postgresql://user:s3cret@127.0.0.1:9/nowhere"
    assert main(["--db", url, "--port", "1"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanotron-dashboard: error: --db "), lines
    assert "s3cret" not in err and "***" in err and "cannot connect" in lines[0]
