"""Token authentication for every HTTP and websocket request, and the CSRF check.

The token never travels further than it must: the login redirect sets a cookie holding an
HMAC of the token (cookie-safe whatever characters the token has, and not the token itself),
the access log has `token=` redacted, and the startup line does not print it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from fastapi import HTTPException, Request

from .errors import StartupConfigError

COOKIE = "nanotron_dashboard_token"
CSRF_HEADER = "x-csrf-token"

Scope = dict[str, Any]


def check_token(token: str, source: str) -> str:
    """A usable token: non-empty, printable, no surrounding whitespace (one line if not)."""
    if not token:
        raise StartupConfigError(f"the token from {source} is empty")
    if not token.isprintable() or token != token.strip():
        raise StartupConfigError(
            f"the token from {source} has whitespace at its ends or unprintable characters"
        )
    return token


def cookie_value(token: str) -> str:
    return hmac.new(token.encode(), b"nanotron-dashboard-cookie", hashlib.sha256).hexdigest()


def _eq(a: bytes | None, b: bytes) -> bool:
    return a is not None and hmac.compare_digest(a, b)


def _cookie(raw: bytes) -> bytes | None:
    for part in raw.split(b";"):
        name, _, value = part.strip().partition(b"=")
        if name == COOKIE.encode():
            return value.strip().strip(b'"')
    return None


def on_site(path: str) -> str:
    """A redirect target that stays on this site: `//evil.example/x` or `/\\evil` would leave it."""
    return "/" + quote(path.lstrip("/\\"), safe="/-._~!$&'()*+,;=:@%")


class TokenMiddleware:
    """With a token: `Authorization: Bearer T`, the cookie, or `?token=T` (which sets the cookie
    and redirects to the same URL without it, so the token does not stay in the address bar)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token.encode()
        self.cookie = cookie_value(token).encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        auth = headers.get(b"authorization", b"")
        bearer = auth[7:].strip() if auth[:7].lower() == b"bearer " else None
        if _eq(bearer, self.token) or _eq(_cookie(headers.get(b"cookie", b"")), self.cookie):
            return await self.app(scope, receive, send)
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        from_query = next((v for k, v in query if k == "token"), None)
        if from_query is not None and _eq(from_query.encode(), self.token):
            if scope["type"] == "http" and scope["method"] == "GET":
                rest = urlencode([(k, v) for k, v in query if k != "token"])
                location = on_site(scope["path"]) + (f"?{rest}" if rest else "")
                cookie = f"{COOKIE}={self.cookie.decode()}; HttpOnly; SameSite=Strict; Path=/"
                await send(
                    {
                        "type": "http.response.start",
                        "status": 303,
                        "headers": [
                            (b"location", location.encode("latin-1")),
                            (b"set-cookie", cookie.encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": b""})
                return
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send(
                {"type": "websocket.close", "code": 1008, "reason": "missing or wrong token"}
            )
            return
        body = json.dumps(
            {
                "detail": "missing or wrong token: send Authorization: Bearer <token> or open "
                "the page with ?token=<token>"
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def require_csrf(request: Request) -> None:
    """State-changing requests from the pages carry the session's CSRF token in a header.

    A custom header cannot be sent cross-origin without a CORS preflight, which this server
    never answers; the token also defeats a same-site page. Compared as bytes, so a
    non-ASCII header is a 403 like any wrong one.
    """
    raw = request.headers.getlist(CSRF_HEADER)
    given = raw[0].encode("latin-1", "replace") if raw else b""
    if not _eq(given, request.app.state.csrf.encode()):
        raise HTTPException(403, "cross-site request refused (missing or wrong X-CSRF-Token)")


_TOKEN_IN_TEXT = re.compile(r"(token=)[^&\s\"']*", re.IGNORECASE)


def redact(text: str) -> str:
    return _TOKEN_IN_TEXT.sub(r"\1<redacted>", text)


class RedactTokens(logging.Filter):
    """On uvicorn's loggers: `?token=...` in a request line becomes `?token=<redacted>`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True
