"""Large heatmap tables written straight into a dashboard database (packed rows, one
executemany), for the read-bound tests: a 4,000-rank interval or 3,000 MoE steps in well under
a second, where ingesting them as messages would take a minute."""

from __future__ import annotations

import json

import numpy as np

from nanotron_dashboard.db import open_database
from nanotron_dashboard.telemetry_messages import RANK_FIELDS

PHASES = [f"phase{i}_ms" for i in range(8)]  # the most unknown phases an interval may hold
ALL_FIELDS = [*RANK_FIELDS, *PHASES]


def new_run(conn, run_id: str) -> int:
    return conn.exec_driver_sql(
        "INSERT INTO runs(id, project, name, status, config, topology, command) "
        "VALUES (?, '', ?, 'running', '{}', '{}', '[]') RETURNING pk",
        (run_id, run_id),
    ).scalar()


def rank_value(step: int, rank: int, col: int) -> float:
    """What bulk rank_stats hold: every cell tells apart."""
    return step * 1000.0 + rank + col / 100


def add_rank_stats(db: str, run_id: str, steps: list[int], n: int) -> None:
    """Intervals of n ranks with every field of ALL_FIELDS."""
    ranks = np.arange(n)
    coords = np.stack([ranks, ranks // 8, ranks % 8, np.zeros(n), np.zeros(n)], 1).astype("<i8")
    hosts = json.dumps([f"node-{r // 8}" for r in range(n)])
    col = np.arange(len(ALL_FIELDS)) / 100
    engine = open_database(db)
    with engine.begin() as conn:
        pk = new_run(conn, run_id)
        rows = [
            (pk, s, float(s), 10, n, coords.tobytes(), hosts,
             (s * 1000.0 + ranks[:, None] + col[None, :]).astype("<f8").tobytes(),
             json.dumps(ALL_FIELDS))
            for s in steps
        ]  # fmt: skip
        conn.exec_driver_sql(
            "INSERT INTO rank_stats(run_pk, step, time, interval, n, coords, hosts, vals, "
            "fields) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
    engine.dispose()


def add_moe_load(db: str, run_id: str, widths: list[int], counts=None) -> None:
    """Layer 0's steps 1, 2, ... with widths[i] experts each; expert e of step s counts
    s + e, unless `counts` (one list per step) says otherwise."""
    engine = open_database(db)
    with engine.begin() as conn:
        pk = new_run(conn, run_id)
        rows = []
        for i, w in enumerate(widths):
            step = i + 1
            c = np.arange(w) + step if counts is None else np.array(counts[i])
            rows.append((pk, 0, step, float(step), w, c.astype("<i8").tobytes()))
        conn.exec_driver_sql(
            "INSERT INTO moe_load(run_pk, layer, step, time, n, counts) VALUES (?, ?, ?, ?, ?, ?)",
            rows,
        )
    engine.dispose()
