"""A token percent-encoded into a URL, once or twice, in the path or the query, is redacted
from the access log like a plain one (issue 44, "Also")."""

from __future__ import annotations

import http.client
from urllib.parse import quote, unquote_plus

from dashboard_helpers import start_dashboard

from nanotron_dashboard.security import Redactor

# shaped like `openssl rand -base64`: `+`, `/` and `=` are what uvicorn re-quotes in a path
TOKEN = "b4se64+tok/en=="


def _encodings(token: str) -> list[str]:
    once = quote(token, safe="")
    return [once, once.lower(), quote(once, safe=""), token.replace("+", "%2B")]


def _decoded(line: str) -> str:
    for _ in range(3):
        line = unquote_plus(line)
    return line


def test_encoded_tokens_are_redacted_from_the_access_log(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTRON_DASHBOARD_TOKEN", TOKEN)
    d = start_dashboard(tmp_path / "runs.db", "--log-level", "info")
    try:
        targets = [f"/api/runs/{e}" for e in _encodings(TOKEN)]
        targets += [f"/api/runs?x={e}" for e in _encodings(TOKEN)]
        targets.append("/api/runs/" + TOKEN.replace("/", "%2F"))  # `+` as sent, quoted by uvicorn
        for target in targets:
            conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
            conn.request("GET", target, headers={"Authorization": f"Bearer {TOKEN}"})
            conn.getresponse().read()
            conn.close()
    finally:
        d.stop()
    log = d.proc.stdout.read().decode()
    lines = [line for line in log.splitlines() if '"GET /api/runs' in line]
    assert len(lines) == len(targets), log  # the access log ran
    for line in lines:
        assert TOKEN not in _decoded(line), line
        assert "<redacted>" in line, line


def test_the_redactor_decodes_only_lines_that_hide_a_secret():
    r = Redactor([TOKEN])
    assert r("GET /static/app%20x.js 200") == "GET /static/app%20x.js 200"  # left as it was
    assert r("GET /a/" + quote(quote(TOKEN, safe=""), safe="")) == "GET /a/<redacted>"
