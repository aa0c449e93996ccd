"""Starting a real dashboard (uvicorn in a child process) on a free port, for the tests."""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# TestClient's default Host ("testserver") is not one the dashboard serves
LOCAL = "http://127.0.0.1:8008"
WS = "ws://127.0.0.1:8008"
JSON_HEADERS = {"content-type": "application/json"}
# the launch token of the dashboards started with --allow-launch (an owner's trainer sends it)
LAUNCH_TOKEN = "launch-token-for-tests"
OWNER_HEADERS = {**JSON_HEADERS, "Authorization": f"Bearer {LAUNCH_TOKEN}"}
# the tests run against both (conftest: db_url, any_live_dashboard, pg_server)
BACKENDS = ["sqlite", "postgresql"]


def run_as_nobody(script: str, *argv: str) -> str:
    """Run a Python script as `nobody`, another real user (the tests run as root); its
    stdout. The attacker of the local-user tests."""
    nobody = pwd.getpwnam("nobody")

    def drop() -> None:
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)

    proc = subprocess.run(
        ["/usr/bin/python3", "-c", script, *argv],
        preexec_fn=drop,
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Dashboard:
    url: str
    db: Path | str  # an SQLite file or a PostgreSQL URL
    port: int
    proc: subprocess.Popen
    token: str | None = None

    def get(self, path: str) -> object:
        req = urllib.request.Request(self.url + path)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: object, token: str | None = None) -> object:
        """POST JSON with `token` (e.g. LAUNCH_TOKEN: an owner's trainer), else the access one."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST")
        req.add_header("content-type", "application/json")
        if token or self.token:
            req.add_header("Authorization", f"Bearer {token or self.token}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        """SIGKILL: no graceful flush, like a crashed or OOM-killed dashboard."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_dashboard(
    db: Path | str, *extra: str, port: int | None = None, token: str | None = None
) -> Dashboard:
    port = port or free_port()
    args = [
        sys.executable,
        "-m",
        "nanotron_dashboard",
        "--db",
        str(db),
        "--port",
        str(port),
        *extra,
    ]
    if token:
        args += ["--token", token]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if "--allow-launch" in extra:
        env.setdefault("NANOTRON_DASHBOARD_LAUNCH_TOKEN", LAUNCH_TOKEN)
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    d = Dashboard(f"http://127.0.0.1:{port}", db, port, proc, token)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dashboard exited: {proc.stdout.read().decode()}")
        try:
            d.get("/api/session")
            return d
        except urllib.error.HTTPError:  # it answers (401: a token it was not given here)
            return d
        except OSError:
            time.sleep(0.1)
    d.kill()
    raise RuntimeError("dashboard did not start in 30 s")
