"""Alerts: one JSON POST per stored event to each `--alert-webhook URL`, and the stall watch.

The writer hands each newly stored event to `WebhookSender.enqueue`, which only puts it on a
bounded queue per URL (a full queue drops the event with a log line): ingest never waits on
a receiver. One thread per URL posts in order, retrying a failure with exponential back-off
and giving up with a log line after the last attempt; a hanging receiver holds up only its
own URL's later alerts, each attempt for at most the timeout.

The payload is the event as `/api/runs/{id}/events` shows it, plus `run_id` and `link` (the
run page's path; `url` adds the server's address): JSON data, no markup, for the receiver to
render as it likes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

from .errors import StartupConfigError

log = logging.getLogger("nanotron_dashboard")
QUEUE_EVENTS = 1000  # per URL
DROP_LOG_EVERY_S = 60.0


def check_webhook_url(url: str) -> str:
    """An http(s) URL with a host, or one line saying why not."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as e:
        raise StartupConfigError(f"--alert-webhook {url[:200]!r}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StartupConfigError(
            f"--alert-webhook {url[:200]!r}: must be an http:// or https:// URL with a host"
        )
    if parts.username is not None or parts.password is not None:
        raise StartupConfigError(
            f"--alert-webhook {shown(url)}: user:password@ in the URL is not supported "
            "(receivers take their secret in the path or query)"
        )
    if any(c.isspace() or not c.isprintable() for c in url):
        raise StartupConfigError(f"--alert-webhook {url[:200]!r}: has whitespace or controls")
    return url


def shown(url: str) -> str:
    """The URL without path and query, for log lines: a webhook's path often is its secret."""
    p = urlsplit(url)
    return f"{p.scheme}://{p.netloc.rpartition('@')[2]}"


def payload(event: dict[str, Any], public_url: str | None) -> bytes:
    link = "/runs/" + quote(event["run_id"], safe="")
    body = {**event, "link": link}
    if public_url:
        body["url"] = public_url + link
    return json.dumps(body, default=str, allow_nan=False).encode()


class _Target:
    """One URL: its queue and the thread that drains it."""

    def __init__(self, url: str, sender: WebhookSender) -> None:
        self.url = url
        self.q: queue.Queue[bytes | None] = queue.Queue(QUEUE_EVENTS)
        self.sender = sender
        self.dropped = 0
        self._dropped_logged = 0.0
        self.thread = threading.Thread(target=self._run, name="dashboard-webhook", daemon=True)

    def offer(self, body: bytes) -> None:
        try:
            self.q.put_nowait(body)
        except queue.Full:
            self.dropped += 1
            now = time.monotonic()
            if now - self._dropped_logged >= DROP_LOG_EVERY_S:
                self._dropped_logged = now
                log.warning(
                    "alert webhook %s: %d alerts queued (the receiver is slow or down); "
                    "dropped %d so far",
                    shown(self.url),
                    QUEUE_EVENTS,
                    self.dropped,
                )

    def _run(self) -> None:
        while True:
            body = self.q.get()
            if body is None or self.sender.stopped:
                return
            self.sender.deliver(self.url, body)


class WebhookSender:
    def __init__(
        self,
        urls: list[str] | tuple[str, ...],
        public_url: str | None = None,
        attempts: int = 5,
        backoff_s: float = 1.0,
        timeout_s: float = 10.0,
    ) -> None:
        self.public_url = public_url
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._targets = [_Target(check_webhook_url(u), self) for u in urls]

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        for t in self._targets:
            t.thread.start()

    def stop(self) -> None:
        self._stop.set()  # ends back-off waits; a request in flight ends by its timeout
        for t in self._targets:
            with contextlib.suppress(queue.Full):  # the thread also sees the stop flag
                t.q.put_nowait(None)

    def enqueue(self, events: list[dict[str, Any]]) -> None:
        """Called by the writer thread after a commit: never blocks."""
        if not self._targets:
            return
        for ev in events:
            try:
                body = payload(ev, self.public_url)
            except (TypeError, ValueError) as e:  # validation keeps details JSON-clean
                log.error("alert webhook: event %s not sent: %s", ev.get("id"), e)
                continue
            for t in self._targets:
                t.offer(body)

    def deliver(self, url: str, body: bytes) -> bool:
        """POST with retries; False (and one log line) when every attempt failed."""
        error = ""
        for attempt in range(self.attempts):
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), 60.0)
                if self._stop.wait(delay):
                    return False
            try:
                req = urllib.request.Request(
                    url, data=body, method="POST", headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    r.read(1 << 16)
                return True
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}"
                if 400 <= e.code < 500 and e.code not in (408, 425, 429):
                    break  # the receiver refuses this request: another try would too
            except (OSError, ValueError) as e:  # refused, reset, timed out, bad response
                error = f"{type(e).__name__}: {e}"[:200]
        log.warning(
            "alert webhook %s: gave up on an event after %d attempt(s) (%s)",
            shown(url),
            attempt + 1,
            error,
        )
        return False


class StallWatch:
    """A thread that asks the writer, every `period` seconds, for a stall check."""

    def __init__(self, submit: Callable[..., Any], job: Any, period_s: float) -> None:
        self._submit = submit  # Writer.submit
        self._pending: Any = None
        self._job = job
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-stall", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            if self._pending is None or self._pending.done():  # a busy writer: no pile-up
                self._pending = self._submit(self._job, want_result=True)
