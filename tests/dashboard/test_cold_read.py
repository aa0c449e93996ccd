"""A cold read (series from sealed blocks + tail rows) equals the warm one (the cache fed by
the writer) and the metrics table itself; a schema-1 database is migrated on open."""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np
from dashboard_helpers import JSON_HEADERS, LOCAL
from fastapi.testclient import TestClient

from nanotron_dashboard import blocks
from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.db import SCHEMA_VERSION, open_database

B = blocks.BLOCK_STEPS
QUERIES = [
    f"names=lm_loss,eval,consumed_tokens&max_points={mp}&x={x}&smoothing={sm}"
    for mp in (64, 50_000)
    for x in ("step", "time", "tokens")
    for sm in (0.0, 0.9)
]


def post(c: TestClient, msgs: list[dict]) -> None:
    for i in range(0, len(msgs), 2000):  # under the 1 MiB message limit
        r = c.post("/api/ingest", content=json.dumps(msgs[i : i + 2000]))
        assert r.status_code == 200, r.text


def loss(s: int, shift: float = 0.0) -> float:
    if s % 401 == 7:
        return math.nan
    if s % 577 == 3:
        return -math.inf if s % 2 else math.inf
    return math.sin(s / 37.0) + s * 1e-3 + shift


def dense(steps: range, shift: float = 0.0) -> list[dict]:
    return [
        {
            "type": "metrics",
            "run_id": "r1",
            "step": s,
            "time": 1000.0 + s * 0.25,
            "values": {"lm_loss": loss(s, shift), "consumed_tokens": float(s * 4096)},
        }
        for s in steps
    ]


def sparse(steps: list[int]) -> list[dict]:
    return [
        {
            "type": "metrics",
            "run_id": "r1",
            "step": s,
            "time": 2000.0 + s,
            "values": {"eval": s / 7},
        }
        for s in steps
    ]


def reference(db: str, name: str) -> list:
    with sqlite3.connect(db) as c:
        rows = c.execute(
            "SELECT step, value FROM metrics WHERE run_pk=1 AND name=? ORDER BY step", (name,)
        ).fetchall()
    return rows


def test_cold_read_returns_the_same_points_as_the_warm_one(tmp_path):
    db = str(tmp_path / "runs.db")
    with TestClient(create_app(Settings(db=db)), base_url=LOCAL, headers=JSON_HEADERS) as c:
        r = c.post("/api/ingest", json={"type": "run_start", "run_id": "r1", "time": 999.0})
        assert r.status_code == 200, r.text
        post(c, dense(range(3000)) + sparse([0, 10, 2500]))
        # replays into sealed blocks: overwritten values, and a point in a block sealed empty
        post(c, dense(range(100, 200), shift=5.0) + sparse([1500]))
        c.get("/api/runs/r1/metrics?names=lm_loss,eval,consumed_tokens")  # load the cache
        post(c, dense(range(3000, 5000)) + sparse([4900]))  # appended to the cached series
        warm = {q: c.get(f"/api/runs/r1/metrics?{q}").json() for q in QUERIES}
    with sqlite3.connect(db) as raw:
        stored = raw.execute(
            "SELECT name, block FROM series_blocks WHERE run_pk=1 ORDER BY name, block"
        ).fetchall()
    # every block below the newest step's block is sealed (the empty block 3 of eval is not stored)
    assert stored == [("consumed_tokens", b) for b in range(4)] + [
        ("eval", b) for b in (0, 1, 2)
    ] + [("lm_loss", b) for b in range(4)]
    with TestClient(
        create_app(Settings(db=db)), base_url=LOCAL, headers=JSON_HEADERS
    ) as c:  # a fresh process: an empty cache
        cold = {q: c.get(f"/api/runs/r1/metrics?{q}").json() for q in QUERIES}
    for q in QUERIES:
        assert cold[q] == warm[q], q
    full = cold[QUERIES[-1].replace("x=tokens", "x=step")]["series"]
    for name in ("lm_loss", "eval"):
        ref = reference(db, name)
        assert full[name]["step"] == [s for s, _ in ref]
        assert full[name]["y"] == [
            v if v is not None and math.isfinite(v) else None for _, v in ref
        ]
    assert full["lm_loss"]["count"] == 5000 and full["eval"]["count"] == 5
    assert full["lm_loss"]["y"][150] == loss(150, shift=5.0)  # the replayed value won
    assert full["eval"]["step"] == [0, 10, 1500, 2500, 4900]


def test_schema_1_database_is_migrated(tmp_path):
    db = tmp_path / "old.db"
    open_database(db).dispose()
    c = sqlite3.connect(db)  # make it look like a file written by schema version 1
    c.execute("DROP TABLE series_blocks")
    c.execute("ALTER TABLE timelines DROP COLUMN clock")
    c.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    c.execute(
        "INSERT INTO runs(id, project, name, status, config, topology, command) "
        "VALUES ('old', '', 'old', 'finished', '{}', '{}', '[]')"
    )
    rows = [(1, "lm_loss", s, None if s == 5 else s * 0.5, 10.0 + s) for s in range(2 * B + 300)]
    c.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?)", rows)
    c.execute("INSERT INTO latest VALUES (1, 'lm_loss', ?, 1.0)", (rows[-1][2],))
    c.commit()
    c.close()
    open_database(db).dispose()
    with sqlite3.connect(db) as c:
        version = c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
        stored = c.execute("SELECT block, n FROM series_blocks ORDER BY block").fetchall()
        steps, values, times = blocks.load(blocks.Raw(c), 1, "lm_loss")
    assert version == str(SCHEMA_VERSION) == "5"
    assert stored == [(0, B), (1, B)]  # the block of the newest step stays rows only
    want = blocks.rows_to_arrays([r[2:] for r in rows])
    assert np.array_equal(steps, want[0]) and np.array_equal(times, want[2])
    assert np.array_equal(values, want[1], equal_nan=True) and np.isnan(values[5])
