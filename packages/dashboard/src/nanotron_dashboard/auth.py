"""Who is asking: the access token, the launch token and the login cookie, for every request.

Two credentials, two levels. The access token (optional on loopback) lets trainers stream
and people read; the launch token (needed by --allow-launch) is the owner's: it can also
start commands. Loopback is not a user boundary (every user of a login node reaches
127.0.0.1), so launching never trusts the network, only the launch token.

The login cookie is never a token: `<level>.<expiry>.<HMAC>` under a secret drawn at each
start, named after this server's port and keyed on it. Browsers send a host's cookies to
every port of it, so another local service may receive one: it is useless on another
server or after a restart, and stops working at its expiry (re-issued while in use).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

ANON, ACCESS, OWNER = 0, 1, 2  # what a request proved
LEVEL_NAMES = {ANON: "anonymous", ACCESS: "access", OWNER: "launch"}
AUTH_KEY = "nanotron_auth"  # the level, in the ASGI scope
COOKIE_MAX_AGE_S = 8 * 3600

Scope = dict[str, Any]


def auth_level(scope: Scope) -> int:
    return scope.get(AUTH_KEY, ANON)


def _eq(a: bytes | None, b: bytes | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a, b)


def on_site(path: str) -> str:
    """A redirect target that stays on this site: `//evil.example/x` or `/\\evil` would leave it."""
    return "/" + quote(path.lstrip("/\\"), safe="/-._~!$&'()*+,;=:@%")


class CookieSigner:
    """Login cookies valid for one server start on one port, for COOKIE_MAX_AGE_S."""

    def __init__(self, port: int, max_age_s: int = COOKIE_MAX_AGE_S) -> None:
        self.port = port
        self.name = f"nanotron_dashboard_{port}"
        self.max_age_s = max_age_s
        self._secret = secrets.token_bytes(32)  # per start: a restart logs everyone out

    def _mac(self, level: int, expires: int) -> str:
        msg = f"{self.port}|{level}|{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def issue(self, level: int, now: float | None = None) -> str:
        expires = int(now if now is not None else time.time()) + self.max_age_s
        return f"{level}.{expires}.{self._mac(level, expires)}"

    def header(self, level: int) -> bytes:
        value = self.issue(level)
        return (
            f"{self.name}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={self.max_age_s}"
        ).encode()

    def check(self, value: bytes | None, now: float | None = None) -> tuple[int, bool]:
        """(level, whether to re-issue: past half its life); ANON if absent, forged or expired."""
        try:
            level_s, expires_s, mac = (value or b"").decode("ascii").split(".")
            level, expires = int(level_s), int(expires_s)
        except (UnicodeDecodeError, ValueError):
            return ANON, False
        now = now if now is not None else time.time()
        if level not in (ACCESS, OWNER) or expires <= now:
            return ANON, False
        if not hmac.compare_digest(mac, self._mac(level, expires)):
            return ANON, False
        return level, expires - now < self.max_age_s / 2

    def read(self, raw_cookie_header: bytes) -> bytes | None:
        for part in raw_cookie_header.split(b";"):
            name, _, value = part.strip().partition(b"=")
            if name == self.name.encode():
                return value.strip().strip(b'"')
        return None


class AuthMiddleware:
    """Sets the request's level in the scope; with an access token, refuses anonymous ones.

    Credentials: `Authorization: Bearer T`, the login cookie, or `?token=T` on a GET (which
    sets the cookie and redirects to the same URL without it, out of the address bar)."""

    def __init__(
        self, app: Any, access: str | None, launch: str | None, cookies: CookieSigner
    ) -> None:
        self.app = app
        self.tokens = [(t.encode(), lvl) for t, lvl in ((launch, OWNER), (access, ACCESS)) if t]
        self.required = access is not None
        self.cookies = cookies

    def _level_of(self, given: bytes | None) -> int:
        for token, level in self.tokens:  # compared with each: no early exit on a match
            if _eq(given, token):
                return level
        return ANON

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        auth = headers.get(b"authorization", b"")
        level = self._level_of(auth[7:].strip() if auth[:7].lower() == b"bearer " else None)
        renew = False
        if level == ANON:
            level, renew = self.cookies.check(self.cookies.read(headers.get(b"cookie", b"")))
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        from_query = next((v for k, v in query if k == "token"), None)
        if from_query is not None:
            q_level = self._level_of(from_query.encode())
            if q_level and scope["type"] == "http" and scope["method"] == "GET":
                rest = urlencode([(k, v) for k, v in query if k != "token"])
                location = on_site(scope["path"]) + (f"?{rest}" if rest else "")
                return await _redirect(send, location, self.cookies.header(q_level))
            level = max(level, q_level)
        if level == ANON and self.required:
            return await _unauthorized(scope, send)
        scope[AUTH_KEY] = level
        if not renew or scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_renewed(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":  # rotation: a fresh expiry while used
                cookie = (b"set-cookie", self.cookies.header(level))
                message = {**message, "headers": [*message.get("headers", []), cookie]}
            await send(message)

        await self.app(scope, receive, send_renewed)


async def _redirect(send: Any, location: str, cookie: bytes) -> None:
    headers = [(b"location", location.encode("latin-1")), (b"set-cookie", cookie)]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _unauthorized(scope: Scope, send: Any) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong token"})
        return
    body = json.dumps(
        {
            "detail": "missing or wrong token: send Authorization: Bearer <token> or open "
            "the page with ?token=<token>"
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def level_name(level: int) -> str:
    return LEVEL_NAMES[level]
