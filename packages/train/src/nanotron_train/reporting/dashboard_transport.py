"""The client's transport: the dashboard's ingest websocket, opened without blocking training
for long, and the dashboard's refusals logged without flooding the training log."""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("nanotron_train.dashboard")


def ingest_url(url: str) -> str:
    """`http://host:port[/prefix]` as the dashboard prints it -> `ws://host:port[/prefix]/ws/ingest`."""
    parts = urlsplit(url.strip())
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"dashboard url {url!r}: expected http://HOST:PORT")
    path = parts.path.rstrip("/")
    return urlunsplit((scheme, parts.netloc, path + "/ws/ingest", "", ""))


def open_ingest(ws_url: str, token: str | None) -> Any:
    """A websocket to `/ws/ingest` (raises when the dashboard is unreachable)."""
    from websockets.sync.client import connect

    headers = {"Authorization": f"Bearer {token}"} if token else None
    kwargs = dict(
        additional_headers=headers,
        open_timeout=3,
        close_timeout=1,
        compression=None,
        max_size=2**22,
    )
    try:  # websockets >= 16 wants `legacy=True` for a connection kept outside a `with`
        return connect(ws_url, legacy=True, **kwargs)
    except TypeError:
        return connect(ws_url, **kwargs)


class Refusals:
    """Counts the dashboard's refusals (4xx: a message out of the protocol's bounds) and logs
    them at most once a minute: a metric refused at every step must not flood the log."""

    def __init__(self) -> None:
        self.count = 0
        self._logged = -1e9

    def note(self, reply: dict[str, Any]) -> None:
        if reply.get("ok") is not False:
            return
        self.count += 1
        now = time.monotonic()
        if now - self._logged >= 60.0:
            self._logged = now
            log.warning(
                "dashboard refused a message (HTTP-like status %s): %s (%d refused so far; "
                "training continues)",
                reply.get("status"),
                reply.get("error"),
                self.count,
            )
