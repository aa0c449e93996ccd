"""The schema's versioned migrations: each release that changes the schema adds a step.

A database records its version in meta.schema_version; at start db.open_database runs, in
order and in its opening transaction, the steps from the version after it to SCHEMA_VERSION
(PostgreSQL's DDL is transactional, and so is SQLite's ALTER TABLE ADD COLUMN: a failed
upgrade leaves the database as it was). New tables need no step: create_all adds them.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

from .paths import key_of


def _to_2(conn: Connection) -> None:
    """Adds series_blocks: create_all creates it and seal_all fills it from the metrics
    already stored (about 2 s per million points, once)."""


def _to_3(conn: Connection) -> None:
    """Adds timelines.clock (the rank clocks' alignment and order violations)."""
    insp = inspect(conn)
    if "timelines" not in insp.get_table_names():
        return  # create_all makes it whole
    if "clock" not in {c["name"] for c in insp.get_columns("timelines")}:
        conn.execute(text("ALTER TABLE timelines ADD COLUMN clock TEXT NOT NULL DEFAULT '{}'"))


def _to_4(conn: Connection) -> None:
    """Adds moe_load (create_all makes it) and rank_stats.fields: the names of the columns a
    row's packed values hold (NULL: the twelve fields of earlier releases), so that a phase
    new to this release (all_to_all_ms) or unknown to it is stored and shown by its name."""
    insp = inspect(conn)
    if "rank_stats" not in insp.get_table_names():
        return
    if "fields" not in {c["name"] for c in insp.get_columns("rank_stats")}:
        conn.execute(text("ALTER TABLE rank_stats ADD COLUMN fields TEXT"))


def _to_5(conn: Connection) -> None:
    """Adds checkpoints.path_key and runs.checkpoints_key (paths.py: the hash of the resolved
    path, indexed), so that a resume finds its parent without resolving every stored path;
    filled here once, resolving each stored path, and adds launch_grants.mac (grants.py:
    a grant of an earlier release has none and must be granted again)."""
    insp = inspect(conn)
    for table, column in (
        ("checkpoints", "path_key"),
        ("runs", "checkpoints_key"),
        ("launch_grants", "mac"),
    ):
        names = insp.get_table_names()
        if table in names and column not in {c["name"] for c in insp.get_columns(table)}:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} VARCHAR"))
    if "checkpoints" not in insp.get_table_names():
        return  # create_all makes them whole
    conn.execute(
        text(f"CREATE INDEX IF NOT EXISTS {CHECKPOINT_KEY_INDEX} ON checkpoints(path_key)")
    )
    conn.execute(text(f"CREATE INDEX IF NOT EXISTS {RUN_KEY_INDEX} ON runs(checkpoints_key)"))
    rows = conn.execute(
        text("SELECT c.id, c.path, r.cwd FROM checkpoints c JOIN runs r ON r.pk = c.run_pk")
    ).fetchall()
    for cid, path, cwd in rows:
        conn.execute(
            text("UPDATE checkpoints SET path_key=:k WHERE id=:id"),
            {"k": key_of(path, cwd), "id": cid},
        )
    runs = conn.execute(
        text("SELECT pk, checkpoints_path, cwd FROM runs WHERE checkpoints_path IS NOT NULL")
    ).fetchall()
    for pk, cpath, cwd in runs:
        conn.execute(
            text("UPDATE runs SET checkpoints_key=:k WHERE pk=:pk"),
            {"k": key_of(cpath, cwd), "pk": pk},
        )


CHECKPOINT_KEY_INDEX = "ix_checkpoints_path_key"
RUN_KEY_INDEX = "ix_runs_checkpoints_key"

# version -> the step that upgrades a database of the version before it.
# 1: first release. 2: adds series_blocks (filled from metrics when a version-1 file opens).
# 3: adds timelines.clock. 4: adds moe_load and rank_stats.fields. 5: adds the resolved-path
# keys of checkpoints and runs, and the launch grants' MAC.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    2: _to_2,
    3: _to_3,
    4: _to_4,
    5: _to_5,
}
SCHEMA_VERSION = max(MIGRATIONS)


def migrate(conn: Connection, from_version: int) -> None:
    """Upgrade an older schema in place, one versioned step at a time."""
    for version in range(from_version + 1, SCHEMA_VERSION + 1):
        MIGRATIONS[version](conn)
