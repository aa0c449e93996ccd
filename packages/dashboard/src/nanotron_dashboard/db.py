"""The schema (SQLAlchemy Core) on SQLite (WAL mode) or PostgreSQL, versioned and migrated in
place at start."""

from __future__ import annotations

import fcntl
import os
import sqlite3
from pathlib import Path
from typing import IO

from sqlalchemy import (
    Column,
    Float,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    inspect,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DatabaseError as SADatabaseError

from .backend import PgLock, Raw, connect_error, is_url, pg_engine, shown
from .blocks import seal_all
from .db_files import open_private, prepare_side_files
from .db_meta import Int64, metadata
from .db_telemetry import TELEMETRY_TABLES  # and its tables, on the same metadata
from .errors import DatabaseFileError
from .migrations import SCHEMA_VERSION, migrate

RECOVER_HINT = (
    "recover what is left with `sqlite3 {path} .recover | sqlite3 recovered.db` and start "
    "with --db recovered.db"
)


meta = Table("meta", metadata, Column("key", String, primary_key=True), Column("value", Text))

runs = Table(
    "runs",
    metadata,
    Column("pk", Integer, primary_key=True, autoincrement=True),
    Column("id", String, nullable=False, unique=True),  # chosen by the trainer
    Column("project", String, nullable=False, default=""),
    Column("name", String, nullable=False, default=""),
    Column("status", String, nullable=False, default="running"),
    Column("config", Text, nullable=False, default="{}"),  # JSON
    Column("world_size", Integer),
    Column("topology", Text, nullable=False, default="{}"),  # JSON
    Column("host", String),
    Column("command", Text, nullable=False, default="[]"),  # JSON list of argv
    Column("cwd", String),
    Column("checkpoints_path", String),
    # paths.key_of(checkpoints_path, cwd): a resume of `<it>/<step>` finds this run by index
    Column("checkpoints_key", String, index=True),
    Column("started", Float),
    Column("updated", Float),
    Column("heartbeat", Float),
    Column("finished", Float),
    Column("error", Text),
    Column("resumed_from_run", String),
    Column("resumed_from_step", Int64),
    Column("step", Int64),
)

# One row per (run, metric, step): a replayed point overwrites instead of duplicating.
# value NULL stands for NaN (SQLite stores NaN as NULL); +-inf are stored as REAL.
metrics = Table(
    "metrics",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("name", String, primary_key=True),
    Column("step", Int64, primary_key=True),
    Column("value", Float),
    Column("time", Float, nullable=False),
    sqlite_with_rowid=False,
)

# The newest value of each metric of each run: the run list reads this, never `metrics`.
latest = Table(
    "latest",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("name", String, primary_key=True),
    Column("step", Int64, nullable=False),
    Column("value", Float),
    sqlite_with_rowid=False,
)

# Derived from `metrics` (see blocks.py): a series' points per block of steps as packed
# little-endian arrays, so a cold read fetches ~250 blobs instead of 250k rows.
series_blocks = Table(
    "series_blocks",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("name", String, primary_key=True),
    Column("block", Integer, primary_key=True),  # steps block*BLOCK_STEPS .. +BLOCK_STEPS-1
    Column("n", Integer, nullable=False),
    Column("steps", LargeBinary, nullable=False),  # int64
    Column("vals", LargeBinary, nullable=False),  # float64, NaN where the value is NULL
    Column("times", LargeBinary, nullable=False),  # float64
)

# The first step at which a run logged a NaN or infinite value (the run list's NaN badge).
# A new table, so create_all adds it to older files without a migration.
run_nonfinite = Table(
    "run_nonfinite",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("step", Int64, nullable=False),
    Column("name", String, nullable=False),
)

# One row per launch of a run (a restart under torchrun --max-restarts, or a relaunch with
# --resume auto, continues the same run id): the run page shows the attempts. A new table too.
run_attempts = Table(
    "run_attempts",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("attempt", String, primary_key=True),  # the trainer's token for one launch
    Column("started", Float, nullable=False),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_pk", Integer, nullable=False),
    Column("step", Int64, nullable=False),
    Column("path", Text, nullable=False),
    Column("consumed_tokens", Int64),
    Column("topology", Text, nullable=False, default="{}"),
    Column("size", Int64),
    Column("complete", Integer, nullable=False, default=1),
    Column("created", Float),
    Column("source", String, nullable=False, default="message"),  # or "disk"
    # paths.key_of(path, the run's cwd), at ingest: a resume finds its parent by index
    Column("path_key", String, index=True),
    UniqueConstraint("run_pk", "step", name="uq_checkpoint_run_step"),
)

# What Resume may run for a run: the command, cwd and checkpoints path exactly as a trainer
# holding the launch token sent them (launch.py). A request never adds to it; a run_start
# without the launch token leaves a run unlaunchable. A new table: no migration.
launch_grants = Table(
    "launch_grants",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("command", Text, nullable=False),  # JSON argv
    Column("cwd", String),
    Column("checkpoints_path", String),
    Column("mac", String),  # grants.py: made with a key only the launch token gives
)


def _on_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; WAL keeps it consistent
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def lock_database(db: str | Path) -> IO[bytes] | PgLock:
    """Hold a lock that makes this the one server of the database: an flock on an SQLite
    file (lock_file), an advisory lock on a PostgreSQL database (backend.PgLock)."""
    if is_url(str(db)):
        return PgLock(str(db))
    return lock_file(db)


def lock_file(path: str | Path) -> IO[bytes]:
    """Hold an flock on the database file itself while serving: a second server on the same
    file, under any path to it (a symlink, a hard link, `..`), refuses to start instead of
    serving series that the first one's writer changes under it.

    flock belongs to the file (its inode), not the name, and SQLite's own locks are POSIX
    locks, which flock does not touch. The descriptor stays open until after the engine is
    disposed (closing a descriptor of the file drops the process's POSIX locks on it). The
    file and its side files must be this user's and private (db_files.py: a new one is
    created 0600). The lock goes with the process, even on SIGKILL.
    """
    fd = open_private(str(path))
    f = os.fdopen(fd, "rb+", buffering=0)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise DatabaseFileError(
            f"--db {path}: another nanotron-dashboard is serving this file (maybe under "
            "another path to it); stop it first or use another --db"
        ) from None
    try:
        prepare_side_files(str(path))  # after the lock: the one server of this file
    except DatabaseFileError:
        f.close()
        raise
    return f


def open_database(db: str | Path) -> Engine:
    """Open (creating if new) the dashboard database, an SQLite file or a PostgreSQL URL,
    and bring its schema to SCHEMA_VERSION; a foreign, corrupt or newer one is an error."""
    if is_url(str(db)):
        engine = pg_engine(str(db))
        try:
            _check_and_create(engine, shown(str(db)))
        except SADatabaseError as e:
            engine.dispose()
            raise connect_error(str(db), e) from None
        except DatabaseFileError:
            engine.dispose()
            raise
        return engine
    path = Path(db)
    if path.exists() and path.is_dir():
        raise DatabaseFileError(f"--db {path}: is a directory, not a database file")
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            if f.read(16) != b"SQLite format 3\x00":
                raise DatabaseFileError(f"--db {path}: not an SQLite database file")
    engine = create_engine(f"sqlite:///{path}", future=True)
    event.listen(engine, "connect", _on_connect)
    try:
        _check_and_create(engine, str(path))
    except SADatabaseError as e:
        engine.dispose()
        raise DatabaseFileError(
            f"--db {path} is corrupt or unreadable ({e.orig}); {RECOVER_HINT.format(path=path)}"
        ) from None
    except DatabaseFileError:
        engine.dispose()
        raise
    return engine


def _check_and_create(engine: Engine, name: str) -> None:
    with engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            problems = [r[0] for r in conn.execute(text("PRAGMA quick_check(5)")).fetchall()]
            if problems != ["ok"]:
                raise DatabaseFileError(
                    f"--db {name} is corrupt ({'; '.join(problems)[:300]}); "
                    + RECOVER_HINT.format(path=name)
                )
        names = set(inspect(conn).get_table_names())
        if names and "meta" not in names:
            raise DatabaseFileError(
                f"--db {name}: a database but not a nanotron dashboard database "
                f"(tables: {', '.join(sorted(names))[:300]})"
            )
        version = SCHEMA_VERSION
        if "meta" in names:
            row = conn.execute(text("SELECT value FROM meta WHERE key='schema_version'")).first()
            version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise DatabaseFileError(
                    f"--db {name}: schema version {version} is newer than this release "
                    f"supports ({SCHEMA_VERSION}); upgrade nanotron-dashboard"
                )
        migrate(conn, version)
        metadata.create_all(conn)
        # completes the migration from 1, and seals rows written without the writer
        seal_all(Raw(conn))
        conn.execute(
            text(
                "INSERT INTO meta(key, value) VALUES ('schema_version', :v) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value"
            ),
            {"v": str(SCHEMA_VERSION)},
        )


def delete_run(conn: object, run_id: str) -> int | None:
    """Delete a run with its series, checkpoints list and flags; its pk, or None if absent.

    Checkpoint folders on disk are left alone: they are the user's files.
    """
    row = conn.exec_driver_sql("SELECT pk FROM runs WHERE id=?", (run_id,)).first()  # type: ignore[attr-defined]
    if row is None:
        return None
    pk = int(row[0])
    for table in (
        "metrics",
        "latest",
        "series_blocks",
        "run_nonfinite",
        "run_attempts",
        "checkpoints",
        "launch_grants",
        *TELEMETRY_TABLES,
    ):
        conn.exec_driver_sql(f"DELETE FROM {table} WHERE run_pk=?", (pk,))  # type: ignore[attr-defined]
    conn.exec_driver_sql("DELETE FROM runs WHERE pk=?", (pk,))  # type: ignore[attr-defined]
    return pk
