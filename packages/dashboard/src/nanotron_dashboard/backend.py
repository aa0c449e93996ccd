"""Where SQLite (the embedded default) and PostgreSQL (a team server) differ, in one place.

The SQL elsewhere is written once, in the subset both speak (ON CONFLICT upserts, RETURNING,
CASE instead of two-argument MAX). What differs is here: how `--db` names a database, the
engine and its one-server-per-database lock, the placeholder style of driver-level SQL
(`?` in the source; psycopg wants `%s`), and a failed write for want of space.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url

from .errors import DatabaseFileError

log = logging.getLogger("nanotron_dashboard")
PG_SCHEMES = ("postgresql://", "postgresql+psycopg://", "postgres://")
# pg_try_advisory_lock's key: one server per PostgreSQL database ("nanotron" in ASCII)
PG_LOCK_KEY = 0x6E616E6F74726F6E


def is_url(db: str) -> bool:
    """A PostgreSQL URL rather than an SQLite file path."""
    return str(db).startswith(PG_SCHEMES)


def pg_url(db: str) -> URL:
    """The SQLAlchemy URL with the psycopg (3) driver, whichever scheme the user wrote."""
    try:
        url = make_url(str(db).replace("postgres://", "postgresql://", 1))
    except Exception as e:  # SQLAlchemy's ArgumentError names the bad part
        raise DatabaseFileError(
            f"--db {shown(db)}: not a valid database URL ({redact(str(e), db)})"
        ) from None
    return url.set(drivername="postgresql+psycopg")


# Query parameters libpq takes a secret from (a `passfile` is a path: shown, never read here)
SECRET_PARAMS = frozenset({"password", "sslpassword"})
MASK = "***"


def _secret(key: str, value: str) -> bool:
    """A secret parameter, or a value libpq may expand into connection options that hold
    one (a `dbname` written as `host=... password=...`)."""
    return key.lower() in SECRET_PARAMS or "password" in value.lower()


def secrets_of(db: str) -> list[str]:
    """Every secret the --db URL holds: the user:password part's and the parameters'."""
    if not is_url(db):
        return []
    try:
        url = make_url(str(db))
    except Exception:
        return []
    found = [url.password] if url.password else []
    for key, value in url.query.items():
        for v in (value,) if isinstance(value, str) else value:
            found += [v] if v and _secret(key, v) else []
    if url.database and "password" in url.database.lower():
        found.append(url.database)
    return sorted(set(map(str, found)), key=len, reverse=True)


def redact(message: str, db: str) -> str:
    """`message` (a driver's error, say) with every secret of the --db URL masked."""
    for secret in secrets_of(db):
        message = message.replace(secret, MASK)
    return message


def shown(db: str) -> str:
    """The --db value as it may be printed or logged: every secret libpq would take from it
    masked (the user:password part's, `password=` and `sslpassword=` parameters, a dbname
    that is a connection string with a password)."""
    if not is_url(db):
        return str(db)
    try:
        url = make_url(str(db))
        query = {
            k: (MASK if any(_secret(k, x) for x in ((v,) if isinstance(v, str) else v)) else v)
            for k, v in url.query.items()
        }
        url = url.set(query=query)
        if url.database and "password" in url.database.lower():
            url = url.set(database=MASK)
        return url.render_as_string(hide_password=True).replace("%2A%2A%2A", MASK)
    except Exception:
        return "postgresql://…"


def _qmark_to_format(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001, ANN202
    """Driver-level SQL is written with SQLite's `?`; psycopg takes `%s`. Statements that
    SQLAlchemy compiled (text(), Core) are already in the driver's style: left alone."""
    if context is not None and context.compiled is None and "?" in statement:
        statement = statement.replace("%", "%%").replace("?", "%s")
    return statement, parameters


def pg_engine(db: str) -> Engine:
    """An engine on a PostgreSQL database. REPEATABLE READ: a series read as its sealed
    blocks plus its newest rows sees one snapshot (the writer is single, so it never
    meets a serialization failure)."""
    engine = create_engine(
        pg_url(db), future=True, isolation_level="REPEATABLE READ", pool_pre_ping=True
    )
    event.listen(engine, "before_cursor_execute", _qmark_to_format, retval=True)
    return engine


class PgLock:
    """The PostgreSQL counterpart of the flock on an SQLite file: a session-level advisory
    lock; a second server on the same database refuses to start. The lock goes with its
    session, even on SIGKILL, and so also when the connection drops (a PostgreSQL restart,
    pg_terminate_backend): the server's writer therefore writes on this very connection
    (`connection()`) and calls `hold()` before each transaction. A session that is not the
    one that took the lock takes it again, or raises LockLost when another server has it:
    no commit is ever made without the lock."""

    def __init__(self, db: str) -> None:
        self._db = db
        self._engine = pg_engine(db)
        try:
            self._conn = self._engine.connect()
        except Exception as e:
            self._engine.dispose()
            raise DatabaseFileError(
                f"--db {shown(db)}: cannot connect ({redact(_first_line(e), db)})"
            ) from None
        if not self._take(self._conn):
            self.close()
            raise DatabaseFileError(
                f"--db {shown(db)}: another nanotron-dashboard is serving this database; "
                "stop it first or use another database"
            )
        self._session = self._conn.connection.dbapi_connection

    @staticmethod
    def _take(conn: Connection) -> bool:
        got = conn.exec_driver_sql("SELECT pg_try_advisory_lock(?)", (PG_LOCK_KEY,)).scalar()
        conn.commit()  # the lock is the session's, not the transaction's
        return bool(got)

    def connection(self) -> Connection:
        return self._conn

    def hold(self, conn: Connection) -> None:
        """Before a write on `conn` (this lock's connection): its session holds the lock. A
        new session (the old one dropped, reconnected since) takes it again first."""
        session = conn.connection.dbapi_connection  # reconnects if the old one was lost
        if session is self._session:
            return
        from .outage import LockLost

        if not self._take(conn):
            raise LockLost("another nanotron-dashboard took this database's lock")
        self._session = session
        log.warning("dashboard: the database connection was lost and the lock taken again")

    def close(self) -> None:
        with suppress(Exception):  # a connection already gone holds no lock
            self._conn.close()
        self._engine.dispose()


def _first_line(e: BaseException) -> str:
    orig = getattr(e, "orig", e)
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0][:300]


def connect_error(db: str, e: BaseException) -> DatabaseFileError:
    return DatabaseFileError(f"--db {shown(db)}: {redact(_first_line(e), db)}")


def is_disk_full(e: BaseException) -> bool:
    """A write refused for want of space: SQLite's SQLITE_FULL, PostgreSQL's 53100."""
    orig = getattr(e, "orig", e)
    if isinstance(orig, sqlite3.OperationalError):
        return getattr(orig, "sqlite_errorcode", None) == 13 or "disk is full" in str(orig)
    return getattr(orig, "sqlstate", None) == "53100"


def is_pg(conn: Connection) -> bool:
    return conn.dialect.name == "postgresql"


def qmarks(n: int) -> str:
    """`(?, ?, ...)` for an IN list of n values; `(NULL)` matches nothing when n is 0."""
    return "(" + ", ".join("?" * n) + ")" if n else "(NULL)"


def tag_filter(conn: Connection) -> str:
    """The run list's ?tag= condition on runs (run_labels.tags is a JSON list of strings)."""
    if is_pg(conn):
        return (
            "pk IN (SELECT l.run_pk FROM run_labels l WHERE "
            "CAST(l.tags AS jsonb) @> jsonb_build_array(CAST(:tag AS text)))"
        )
    return "pk IN (SELECT l.run_pk FROM run_labels l, json_each(l.tags) t WHERE t.value = :tag)"


class Raw:
    """The DB-API connection under a SQLAlchemy one, for the bulk paths (blocks.py) where
    SQLAlchemy's rows cost too much; SQL written with `?` on either backend."""

    def __init__(self, conn: Connection | sqlite3.Connection) -> None:
        if isinstance(conn, sqlite3.Connection):  # a file opened without SQLAlchemy
            self.pg, self._c = False, conn
            return
        self.pg = is_pg(conn)
        self._c = conn.connection.driver_connection

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        if self.pg:
            cur = self._c.cursor()
            cur.execute(sql.replace("?", "%s"), params)
            return cur
        return self._c.execute(sql, params)

    def executemany(self, sql: str, rows: list[Sequence[Any]]) -> None:
        if self.pg:
            with self._c.cursor() as cur:
                cur.executemany(sql.replace("?", "%s"), rows)
        else:
            self._c.executemany(sql, rows)

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """Reads that see one state of the database. SQLite's driver opens no transaction
        for a SELECT, so one is begun here; PostgreSQL's already runs in REPEATABLE READ."""
        began = not self.pg and not self._c.in_transaction
        if began:
            self._c.execute("BEGIN")
        try:
            yield
        finally:
            if began:
                self._c.execute("COMMIT")
