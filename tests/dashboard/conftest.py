import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dashboard_helpers import start_dashboard  # noqa: E402


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
