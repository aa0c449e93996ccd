"""When the database is out of reach (PostgreSQL stopped, restarting, its connection cut) or
this server no longer holds its one-server lock: requests are answered 503 with Retry-After
(the trainer's client waits that long and sends again; nothing it was told is stored is
lost), and the log gets one line when it starts and one when it is over, not a traceback per
request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy.exc import DBAPIError

log = logging.getLogger("nanotron_dashboard")

RETRY_AFTER_S = 2
# SQLSTATE classes of a connection gone: 08 connection exception; 57P01-03 the server shutting
# down or starting up
_GONE = ("08", "57P01", "57P02", "57P03")


class LockLost(RuntimeError):
    """Another server holds the database's one-server lock that this one lost with its
    connection: writing now would make two writers."""


def is_unavailable(e: BaseException) -> bool:
    """The database cannot be reached: no fault of the request (SQLite never says so)."""
    if isinstance(e, LockLost):
        return True
    if isinstance(e, DBAPIError) and e.connection_invalidated:
        return True
    orig = getattr(e, "orig", e)
    state = getattr(orig, "sqlstate", None)
    if state:
        return state.startswith(_GONE)
    try:
        import psycopg
    except ImportError:  # no PostgreSQL driver: an SQLite server
        return False
    # no SQLSTATE: the connection itself failed (refused, reset, timed out)
    return isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)


def unavailable(e: BaseException) -> dict[str, Any]:
    """The refusal of a request the database could not take (the writer's result form)."""
    if isinstance(e, LockLost):
        why = "another nanotron-dashboard serves this database now"
    else:
        why = "the dashboard's database is unavailable"
    return {
        "ok": False,
        "status": 503,
        "error": f"{why}; retry later",
        "retry_after": RETRY_AFTER_S,
    }


class Outage:
    """Whether the database is out of reach now, logged once when that starts and once when
    it ends (the writer's next commit), whatever the number of requests in between."""

    def __init__(self, redact: Any = str) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None
        self._lost = False  # LockLost logged in this outage
        self._redact = redact  # masks the --db URL's secrets in a driver's message

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, e: BaseException) -> None:
        if isinstance(e, LockLost):
            self._lock_lost()
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        orig = getattr(e, "orig", e)
        first = (str(orig).strip().splitlines() or [type(orig).__name__])[0][:300]
        log.error(
            "dashboard: the database is unavailable (%s); answering 503 with Retry-After until "
            "it is back (one line now, one when it is back)",
            self._redact(first),
        )

    def _lock_lost(self) -> None:
        with self._lock:
            if self._lost:
                return
            self._lost = True
        log.error(
            "dashboard: another nanotron-dashboard took this database's lock while this one's "
            "connection was down; this one no longer writes (503) until it can take the lock "
            "again: stop one of them"
        )

    def ok(self) -> None:
        if self._since is None:  # the common case: no lock taken
            return
        with self._lock:
            since, self._since, self._lost = self._since, None, False
        if since is not None:
            log.warning(
                "dashboard: the database is back after %.1f s; writing again",
                time.monotonic() - since,
            )
