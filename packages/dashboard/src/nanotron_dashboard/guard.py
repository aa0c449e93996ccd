"""The browser threat model at the door: Host allow-list, Origin check and security headers.

A page on another origin can make the user's browser send requests to the dashboard
(cross-site requests), and can point a DNS name it controls at 127.0.0.1 (DNS rebinding): the
browser then thinks the dashboard *is* that site and lets the page read it. The defences:

- Host: only the bound host, the loopback names and `--allowed-host` names are served; a
  rebinding page's requests carry its own name and get 421 (400 without a usable Host).
- Origin: a request or websocket handshake whose Origin is not the dashboard's own is
  refused with 403. Browsers send Origin on every state-changing request and every websocket
  handshake; trainers, curl and scripts send none.
- NUL bytes: a path or query parameter holding one is refused (404, 400) before any route
  reads it, the same on SQLite and PostgreSQL (whose text cannot hold one).
- Headers: CSP `default-src 'self'` and `frame-ancestors 'none'` plus `X-Frame-Options: DENY`
  (no clickjacking of the Resume button), `Cross-Origin-Resource-Policy: same-origin` (no
  cross-site reads of responses) and `Referrer-Policy: no-referrer`.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Any
from urllib.parse import unquote_to_bytes

Scope = dict[str, Any]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})
CSP = (
    "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'; "
    "object-src 'none'"
)


def hostname_of(host_header: str) -> str | None:
    """`Name:port`, `[v6]:port` or `name` -> lower-case name without port; None if malformed."""
    h = host_header.strip().lower()
    if not h:
        return None
    if h.startswith("["):
        end = h.find("]")
        if end < 0 or (h[end + 1 :] and not h[end + 1 :].startswith(":")):
            return None
        name, port = h[1:end], h[end + 2 :]
    else:
        name, _, port = h.partition(":")
    if port and not port.isdigit():
        return None
    name = name.rstrip(".")
    if not name or any(c in name for c in "/\\@ \t"):
        return None
    return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostPolicy:
    """Which Host names this server answers to."""

    def __init__(self, bound: str, extra: list[str] | tuple[str, ...] = ()) -> None:
        names = set(LOOPBACK_NAMES) | {h.strip().lower().strip("[]") for h in extra if h.strip()}
        self.wildcard = bound in WILDCARDS
        if self.wildcard:  # reachable by this machine's names and any of its addresses
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        else:
            names.add(bound.lower().strip("[]"))
        self.names = frozenset(names)

    def allows(self, name: str) -> bool:
        # an IP literal cannot be DNS rebinding (that needs a name the attacker controls)
        return name in self.names or (self.wildcard and _is_ip(name))


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def same_origin(origin: str, host: str) -> bool:
    o = origin.strip().lower()
    return o in (f"http://{host.lower()}", f"https://{host.lower()}")


async def refuse(scope: Scope, send: Any, status: int, detail: str) -> None:
    """A JSON error for HTTP; for a websocket, a close before accept (HTTP 403 to the client)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": detail[:120]})
        return
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *security_headers(scope)],
        }
    )
    await send({"type": "http.response.body", "body": body})


def security_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    out = [
        (b"x-frame-options", b"DENY"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        (b"cross-origin-resource-policy", b"same-origin"),
    ]
    out.append((b"content-security-policy", CSP.encode()))
    return out


def nul_in_url(scope: Scope) -> tuple[int, str] | None:
    """A NUL byte in the path or a query parameter: PostgreSQL's text cannot hold one (its
    driver fails the statement), SQLite's can. Refused here, for every route on both
    backends: a path with one names nothing (404), a query parameter is refused (400)."""
    if "\x00" in scope.get("path", ""):
        return 404, "not found (a NUL byte in the path)"
    if b"\x00" in unquote_to_bytes(scope.get("query_string", b"")):
        return 400, "a NUL byte in the query string: no parameter may hold one"
    return None


class BrowserGuard:
    """ASGI middleware, outermost: runs before the token check and every route."""

    def __init__(self, app: Any, hosts: HostPolicy) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        host = _header(scope, b"host")
        name = hostname_of(host) if host is not None else None
        if name is None:
            return await refuse(scope, send, 400, "missing or malformed Host header")
        if not self.hosts.allows(name):
            return await refuse(
                scope,
                send,
                421,
                f"this dashboard does not serve the host name {name!r} (a DNS rebinding "
                f"guard): open it by a name it serves, or start it with --allowed-host {name}",
            )
        origin = _header(scope, b"origin")
        if origin is not None and not same_origin(origin, host or ""):
            return await refuse(
                scope, send, 403, f"cross-origin request refused (Origin {origin[:100]!r})"
            )
        nul = nul_in_url(scope)
        if nul is not None:
            return await refuse(scope, send, *nul)
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        extra = security_headers(scope)

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
