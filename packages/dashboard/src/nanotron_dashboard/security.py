"""Token authentication for every HTTP and websocket request, and the CSRF check for launches."""

from __future__ import annotations

import contextlib
import hmac
import json
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

COOKIE = "nanotron_dashboard_token"

Scope = dict[str, Any]


def _same(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


class TokenMiddleware:
    """With a token: `Authorization: Bearer T`, the cookie, or `?token=T` (which sets the cookie
    and redirects to the same URL without it, so the token does not stay in the address bar)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        auth = headers.get("authorization", "")
        bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        cookie = SimpleCookie()
        with contextlib.suppress(Exception):
            cookie.load(headers.get("cookie", ""))
        from_cookie = cookie[COOKIE].value if COOKIE in cookie else None
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        from_query = next((v for k, v in query if k == "token"), None)
        if _same(bearer, self.token) or _same(from_cookie, self.token):
            return await self.app(scope, receive, send)
        if _same(from_query, self.token):
            if scope["type"] == "http" and scope["method"] == "GET":
                rest = urlencode([(k, v) for k, v in query if k != "token"])
                location = scope["path"] + (f"?{rest}" if rest else "")
                await send(
                    {
                        "type": "http.response.start",
                        "status": 303,
                        "headers": [
                            (b"location", location.encode("latin-1")),
                            (
                                b"set-cookie",
                                f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/".encode(),
                            ),
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
                "detail": "missing or wrong token: send Authorization: Bearer <token> or open the page with ?token=<token>"
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


def same_origin(headers: dict[str, str]) -> bool:
    """A browser's cross-site POST carries a foreign Origin; non-browser clients send none."""
    origin = headers.get("origin")
    if origin is None:
        return True
    host = headers.get("host", "")
    return origin in (f"http://{host}", f"https://{host}")
