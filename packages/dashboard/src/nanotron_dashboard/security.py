"""Token checks at startup, the CSRF check, and keeping secrets out of every log line.

The tokens never travel further than they must: the login sets a cookie that is not a token
(see auth.py), the startup line does not print them, and every log record, at every level
and from every library, has the tokens, `Authorization` values, `token=` parameters and
login cookies redacted before any handler writes it, also when percent-encoded (once or
more) into a URL.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Iterable
from urllib.parse import unquote, unquote_plus

from fastapi import HTTPException, Request

from .auth import ACCESS, auth_level
from .errors import StartupConfigError

CSRF_HEADER = "x-csrf-token"
MAX_DECODINGS = 3  # percent-decodings tried on a log line that holds a `%`


def check_token(token: str, source: str) -> str:
    """A usable token: non-empty, printable, no surrounding whitespace (one line if not)."""
    if not token:
        raise StartupConfigError(f"the token from {source} is empty")
    if not token.isprintable() or token != token.strip():
        raise StartupConfigError(
            f"the token from {source} has whitespace at its ends or unprintable characters"
        )
    return token


def csrf_allowed(request: Request) -> bool:
    """Whether this request may have the CSRF token: it proved a credential, or the server
    has none at all (open mode: loopback, no token, no launching)."""
    s = request.app.state.settings
    if s.token is None and s.launch_token is None:
        return True
    return auth_level(request.scope) >= ACCESS


def require_csrf(request: Request) -> None:
    """State-changing requests from the pages carry the session's CSRF token in a header.

    A custom header cannot be sent cross-origin without a CORS preflight, which this server
    never answers; the token also defeats a same-site page. Compared as bytes, so a
    non-ASCII header is a 403 like any wrong one. Only a request that could have been given
    the token passes: an anonymous one on a server with credentials is refused before.
    """
    if not csrf_allowed(request):
        raise HTTPException(401, "sign in first: open the dashboard with ?token=<token>")
    raw = request.headers.getlist(CSRF_HEADER)
    given = raw[0].encode("latin-1", "replace") if raw else b""
    if not hmac.compare_digest(given, request.app.state.csrf.encode()):
        raise HTTPException(403, "cross-site request refused (missing or wrong X-CSRF-Token)")


_PATTERNS = (
    re.compile(r"(token=)[^&\s\"']*", re.IGNORECASE),
    re.compile(r"(bearer\s+)[^\s\"',\]]+", re.IGNORECASE),
    re.compile(r"(nanotron_dashboard_\d+=)[^;\s\"',\]]*", re.IGNORECASE),
)


class Redactor:
    """Replaces the known secrets and anything shaped like a credential with <redacted>."""

    def __init__(self, secrets_: Iterable[str | None] = ()) -> None:
        self.secrets = sorted({s for s in secrets_ if s}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        text = self._plain(text)
        if "%" in text or "+" in text:
            return self._decoded(text)
        return text

    def _plain(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "<redacted>")
        for p in _PATTERNS:
            text = p.sub(r"\1<redacted>", text)
        return text

    def _decoded(self, text: str) -> str:
        """A secret a client percent-encoded (in a path, uvicorn's access log re-quotes
        what it decoded; a query string is logged as sent, maybe encoded twice) is found
        in the decoded text: the line is then written decoded, with it redacted."""
        for decode in (unquote, unquote_plus):
            seen = text
            for _ in range(MAX_DECODINGS):
                nxt = decode(seen)
                if nxt == seen:
                    break
                seen = nxt
                clean = self._plain(seen)
                if clean != seen:
                    return clean
        return text


redact = Redactor()


class RedactTokens(logging.Filter):
    """On every handler: secrets redacted from the message, each argument (a token inside
    bytes, a header list or a dict is caught through its text) and the traceback text.

    Arguments are redacted one by one, not folded into the message: uvicorn's access
    formatter unpacks them."""

    def __init__(self, redactor: Redactor = redact) -> None:
        super().__init__()
        self.redactor = redactor

    def _arg(self, a: object) -> object:
        if isinstance(a, str):
            return self.redactor(a)
        if isinstance(a, (int, float)) or a is None:
            return a
        text = str(a)
        clean = self.redactor(text)
        return a if clean == text else clean

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.redactor(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self._arg(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: self._arg(v) for k, v in record.args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redactor(record.exc_text)
        return True


def install_redaction(redactor: Redactor) -> None:
    """Put the filter on every handler that exists now (root's, uvicorn's, any library's)."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for lg in loggers:
        for h in getattr(lg, "handlers", []):
            if not any(isinstance(f, RedactTokens) for f in h.filters):
                h.addFilter(RedactTokens(redactor))


__all__ = ["check_token", "csrf_allowed", "install_redaction", "require_csrf"]
