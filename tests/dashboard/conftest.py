import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dashboard_helpers import BACKENDS, start_dashboard  # noqa: E402


@pytest.fixture(scope="session")
def live_dashboard(tmp_path_factory):
    """One shared real dashboard (uvicorn, --allow-launch) for the tests that need a socket."""
    d = start_dashboard(tmp_path_factory.mktemp("dash") / "runs.db", "--allow-launch")
    yield d
    d.stop()


CHROMIUM = os.environ.get("NANOTRON_CHROMIUM", "/usr/bin/chromium")
# the hostile-page tests reach the dashboard under a foreign name, as DNS rebinding would
REBIND_NAME = "rebind.evil.example"


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium (Debian's package, driven by Playwright) for all browser tests."""
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        if os.environ.get("CI") == "true":
            pytest.fail(f"Chromium not found at {CHROMIUM}: install Debian's chromium package")
        pytest.skip(f"Chromium not found at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                f"--host-resolver-rules=MAP {REBIND_NAME} 127.0.0.1",
            ],
        )
        yield b
        b.close()


@pytest.fixture(scope="session")
def pg_server():
    """One real PostgreSQL server for the session (Debian's package). Under CI a missing or
    broken server fails the tests that need it; elsewhere they are skipped."""
    from pg_server import start

    try:
        server = start()
    except (RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        msg = f"PostgreSQL: {e} {detail.decode(errors='replace')[-500:]}"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    yield server
    server.stop()


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path):
    """--db for one test on each backend: an SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return request.getfixturevalue("pg_server").fresh_database()


@pytest.fixture(scope="session")
def live_pg_dashboard(tmp_path_factory, pg_server):
    """The live dashboard's twin on PostgreSQL (uvicorn, --allow-launch); its launch logs
    (under $XDG_CACHE_HOME for a database URL) in a temporary folder."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    try:
        d = start_dashboard(pg_server.fresh_database(), "--allow-launch")
    finally:
        if before is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = before
    yield d
    d.stop()


@pytest.fixture(params=BACKENDS)
def any_live_dashboard(request):
    """A real dashboard on each backend, for the tests run against both."""
    name = "live_dashboard" if request.param == "sqlite" else "live_pg_dashboard"
    return request.getfixturevalue(name)
