"""Cross-site defences in real Chromium: a hostile page served from a second local port attacks the
dashboard (--allow-launch, no token) with a form POST, fetch(no-cors), an iframe of the run
page and websockets, and DNS rebinding reaches it under a foreign name. None of it may
change a run, launch a command, or read data."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import REBIND_NAME

pytestmark = pytest.mark.browser

EVIL_PAGE = """<!doctype html><html><body>
<iframe name="sink" id="sink"></iframe>
<form id="f" method="POST" action="DASH/api/ingest" enctype="text/plain" target="sink">
<input name='{"type":"run_start","run_id":"victim-b","command":["sh","-c","touch MARK"],"cwd":"/tmp","project":"' value='x"}'>
</form>
<iframe id="framed" src="DASH/runs/victim-b" width="800" height="300"></iframe>
<script>
window.results = {};
const hijack = JSON.stringify(HIJACK);
function ws(url, send) {
  return new Promise((res) => {
    const w = new WebSocket(url);
    w.onopen = () => { if (send) w.send(send); res("open"); };
    w.onerror = () => res("error");
    setTimeout(() => res("timeout"), 5000);
  });
}
(async () => {
  document.getElementById("f").submit();
  await fetch("DASH/api/ingest", { method: "POST", mode: "no-cors", body: hijack,
    headers: { "Content-Type": "text/plain" } }).catch(() => null);
  await fetch("DASH/api/checkpoints/CKID/resume", { method: "POST", mode: "no-cors" }).catch(() => null);
  try { const r = await fetch("DASH/api/session"); results.session = await r.text(); }
  catch (e) { results.session = "blocked"; }
  try { const r = await fetch("DASH/api/runs/victim-b", { mode: "no-cors" });
        results.read = r.type + ":" + (await r.text()).length; }
  catch (e) { results.read = "blocked"; }
  results.ws_ingest = await ws("WSDASH/ws/ingest", hijack);
  results.ws_feed = await ws("WSDASH/ws/runs/victim-b");
  results.done = true;
})();
</script></body></html>"""


class _Evil(BaseHTTPRequestHandler):
    page = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args: object) -> None:
        pass


def test_hostile_page_cannot_change_launch_or_read(browser, live_dashboard, tmp_path):
    d = live_dashboard
    launched = tmp_path / "launched"
    command = [sys.executable, "-c", f"open({str(launched)!r}, 'w').write('x')"]
    d.post(
        "/api/ingest",
        {"type": "run_start", "run_id": "victim-b", "command": command, "cwd": str(tmp_path)},
    )
    d.post("/api/ingest", {"type": "checkpoint", "run_id": "victim-b", "step": 3, "path": "c/3"})
    ck = d.get("/api/runs/victim-b/checkpoints")[0]["id"]
    before = d.get("/api/runs/victim-b")
    runs_before = {r["id"] for r in d.get("/api/runs?limit=1000")}
    hijack = {
        "type": "run_start",
        "run_id": "victim-b",
        "command": ["touch", str(tmp_path / "pwned")],
        "cwd": "/tmp",
    }
    page_html = (
        EVIL_PAGE.replace("WSDASH", d.url.replace("http", "ws", 1))
        .replace("DASH", d.url)
        .replace("CKID", str(ck))
        .replace("HIJACK", json.dumps(hijack))
        .replace("MARK", str(tmp_path / "pwned"))
    )
    _Evil.page = page_html.encode()
    evil = ThreadingHTTPServer(("127.0.0.1", 0), _Evil)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(f"http://127.0.0.1:{evil.server_address[1]}/")
        page.wait_for_function("() => window.results && window.results.done", timeout=20_000)
        results = page.evaluate("() => window.results")
        assert results["session"] == "blocked"  # no CORS: the CSRF token is not readable
        assert results["read"] == "blocked"  # CORP: not even an opaque response
        assert results["ws_ingest"] == "error" and results["ws_feed"] == "error"
        # the framed run page was refused by frame-ancestors / X-Frame-Options
        framed = [f for f in page.frames if f != page.main_frame]
        assert framed
        for f in framed:
            assert f.locator("#run-name").count() == 0, f.url

        # DNS rebinding: the dashboard under a foreign name is refused before any route
        resp = page.goto(f"http://{REBIND_NAME}:{d.port}/api/session")
        assert resp.status == 421 and "csrf" not in page.content()
    finally:
        ctx.close()
        evil.shutdown()
    after = d.get("/api/runs/victim-b")
    for key in ("command", "cwd", "checkpoints_path", "project", "config", "status"):
        assert after[key] == before[key], key
    assert {r["id"] for r in d.get("/api/runs?limit=1000")} == runs_before  # nothing created
    assert not launched.exists() and not (tmp_path / "pwned").exists()
