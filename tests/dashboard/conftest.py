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
