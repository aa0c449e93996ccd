"""Alert webhooks: `--alert-webhook URL`: one JSON POST per stored event (trainer's and derived),
retried with back-off then given up with a log line, never blocking ingest."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import telemetry_data as td
from dashboard_helpers import JSON_HEADERS, LOCAL
from fastapi.testclient import TestClient

from nanotron_dashboard.alerts import QUEUE_EVENTS, WebhookSender
from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.cli import main

TRAINER_KINDS = (
    "nonfinite_loss",
    "loss_spike",
    "grad_norm_spike",
    "throughput_drop",
    "straggler",
    "stall",  # the trainer's hang watchdog
    "preemption",
)


class Receiver:
    """A local HTTP server recording each POST; `status` is what it answers (a list is
    consumed one per request), `gate` when set makes each request wait for it."""

    def __init__(self, status=200):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.status = status
        self.gate: threading.Event | None = None
        self.arrived = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["content-length"]))
                outer.headers.append(dict(self.headers))
                outer.bodies.append(json.loads(body))
                outer.arrived.set()
                if outer.gate is not None:
                    outer.gate.wait(60)
                status = outer.status.pop(0) if isinstance(outer.status, list) else outer.status
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook/secret-path"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        if self.gate is not None:
            self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver():
    r = Receiver()
    yield r
    r.close()


def app_with(tmp_path, urls, **kw):
    settings = Settings(db=str(tmp_path / "w.db"), alert_webhooks=tuple(urls), **kw)
    return TestClient(create_app(settings), base_url=LOCAL, headers=JSON_HEADERS)


def post(c, msg):
    r = c.post("/api/ingest", content=json.dumps(msg))
    assert r.status_code == 200, r.text


def wait_for(fn, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_each_event_kind_is_posted_exactly_once(tmp_path, receiver):
    with app_with(tmp_path, [receiver.url], stall_after=0.4, webhook_backoff_s=0.01) as c:
        post(c, {"type": "run_start", "run_id": "w"})
        for step, kind in enumerate(TRAINER_KINDS):
            msg = td.event("w", kind, step, message=f"<b>{kind}</b> & co")
            post(c, msg)
            post(c, msg)  # a replay is stored once, so posted once
        post(c, {"type": "run_end", "run_id": "w", "status": "preempted"})  # never stalls
        # derived: a restart (a new launch of a known run), then a stall (silence)
        post(c, {"type": "run_start", "run_id": "w2", "attempt": "a"})
        post(c, {"type": "metrics", "run_id": "w2", "step": 3, "values": {"lm_loss": 1.0}})
        post(c, {"type": "run_start", "run_id": "w2", "attempt": "b"})
        wait_for(lambda: any(b["kind"] == "stall" and b["run_id"] == "w2" for b in receiver.bodies))
        time.sleep(1.0)  # more stall checks run: the same silence is not posted again
        # per URL the posts go in order: once this one arrives, all before it have
        post(c, {"type": "run_start", "run_id": "w3"})
        post(c, td.event("w3", "loss_spike", 1, message="sentinel"))
        wait_for(lambda: any(b["message"] == "sentinel" for b in receiver.bodies))
    got = sorted((b["run_id"], b["kind"], b["source"]) for b in receiver.bodies)
    want = sorted(
        [("w", k, "trainer") for k in TRAINER_KINDS]
        + [("w2", "restart", "dashboard"), ("w2", "stall", "dashboard")]
        + [("w3", "loss_spike", "trainer")]
    )
    assert got == want
    straggler = next(b for b in receiver.bodies if b["kind"] == "straggler")
    # the event as the API shows it, plus run_id and the run page's link; text is data
    assert straggler["message"] == "<b>straggler</b> & co"
    assert straggler["link"] == "/runs/w" and straggler["url"] == "http://127.0.0.1:8008/runs/w"
    assert (straggler["step"], straggler["severity"]) == (
        TRAINER_KINDS.index("straggler"),
        "warning",
    )
    assert set(straggler) == {
        "id", "run_id", "step", "time", "kind", "severity", "message", "details", "source",
        "link", "url",
    }  # fmt: skip
    restart = next(b for b in receiver.bodies if b["kind"] == "restart")
    assert restart["step"] == 3 and restart["details"]["attempt"] == "b"
    assert all(h["Content-Type"] == "application/json" for h in receiver.headers)


def test_a_failing_receiver_is_retried_then_given_up_with_a_log_line(tmp_path, caplog):
    fail = Receiver(status=500)
    flaky = Receiver(status=[503, 502, 200])
    refuses = Receiver(status=400)
    caplog.set_level(logging.WARNING, logger="nanotron_dashboard")
    try:
        urls = [fail.url, flaky.url, refuses.url]
        with app_with(tmp_path, urls, webhook_attempts=3, webhook_backoff_s=0.01) as c:
            post(c, {"type": "run_start", "run_id": "f"})
            post(c, td.straggler("f", 1))
            wait_for(lambda: len(fail.bodies) == 3 and len(flaky.bodies) == 3)
            wait_for(lambda: sum("gave up" in r.message for r in caplog.records) == 2)
        assert [b["kind"] for b in fail.bodies] == ["straggler"] * 3  # the same event, 3 tries
        assert len(refuses.bodies) == 1  # a 4xx refusal is not retried
        lines = sorted(r.getMessage() for r in caplog.records if "gave up" in r.getMessage())
        port = fail.url.split(":")[2].split("/")[0]
        assert (
            f"alert webhook http://127.0.0.1:{port}: gave up on an event after 3 attempt(s) "
            "(HTTP 500)"
        ) in lines
        assert all("secret-path" not in line for line in lines)  # the path may be a secret
        assert any("after 1 attempt(s) (HTTP 400)" in line for line in lines)
    finally:
        for r in (fail, flaky, refuses):
            r.close()


def test_a_hanging_receiver_does_not_block_ingest(tmp_path, receiver):
    receiver.gate = threading.Event()  # every request hangs until the test releases it
    with app_with(tmp_path, [receiver.url], webhook_timeout_s=60) as c:
        post(c, {"type": "run_start", "run_id": "h"})
        post(c, td.event("h", "loss_spike", 0))
        assert receiver.arrived.wait(20)  # the sender thread is now stuck in that request
        for step in range(1, 41):  # ingest goes on: events and metrics stored meanwhile
            post(c, td.event("h", "loss_spike", step))
            post(c, {"type": "metrics", "run_id": "h", "step": step, "values": {"x": 1.0}})
        assert not receiver.gate.is_set() and len(receiver.bodies) == 1
        assert len(c.get("/api/runs/h/events").json()) == 41
        assert c.get("/api/runs/h").json()["step"] == 40
        receiver.gate.set()
        wait_for(lambda: len(receiver.bodies) == 41)  # then delivered, in order
    assert [b["step"] for b in receiver.bodies] == list(range(41))


@pytest.mark.parametrize(
    "args,why",
    [
        (["--alert-webhook", "ftp://example.com/x"], "must be an http:// or https:// URL"),
        (["--alert-webhook", "http:///nohost"], "must be an http:// or https:// URL"),
        (["--alert-webhook", "http://h:99999/"], "not a URL"),
        (["--alert-webhook", "https://u:pw@h.example/x"], "user:password@ in the URL is not"),
        (["--stall-after", "0"], "--stall-after 0.0: must be > 0 seconds"),
    ],
)
def test_bad_alert_options_are_one_line_and_exit_2(tmp_path, capsys, args, why):
    assert main(["--db", str(tmp_path / "x.db"), *args]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.db").exists()  # refused before the database is made


def test_the_queue_per_url_is_bounded_and_overflow_is_logged(caplog):
    """A receiver that never keeps up costs at most QUEUE_EVENTS events of memory."""
    caplog.set_level(logging.WARNING, logger="nanotron_dashboard")
    sender = WebhookSender(["http://127.0.0.1:9/a", "http://127.0.0.1:9/b"])  # not started
    ev = {"id": 1, "run_id": "r", "kind": "stall", "message": "m", "details": {}}
    sender.enqueue([ev] * (QUEUE_EVENTS + 5))
    assert [t.q.qsize() for t in sender._targets] == [QUEUE_EVENTS] * 2
    assert [t.dropped for t in sender._targets] == [5, 5]
    lines = [r.getMessage() for r in caplog.records]
    assert (
        lines
        == [
            f"alert webhook http://127.0.0.1:9: {QUEUE_EVENTS} alerts queued (the receiver is slow "
            "or down); dropped 1 so far"
        ]
        * 2
    )  # one line a minute per URL, not one per event
