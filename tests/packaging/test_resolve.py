"""Each package installs alone with only its own dependencies (pip resolves, installs nothing).

`pip install --dry-run --report` resolves against the package index exactly as a real
install would, so the report lists everything `pip install ./packages/X` would pull in.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"nanotron-parallel", "nanotron-models", "nanotron-train", "nanotron-dashboard"}
WEB_STACK = {"fastapi", "uvicorn", "sqlalchemy", "websockets", "pydantic", "starlette"}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def resolve(package: str, tmp_path: Path) -> set[str]:
    """Names of every distribution `pip install ./packages/<package>` would install."""
    report = tmp_path / f"{package}.json"
    cmd = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
        "--report", str(report), "-c", str(ROOT / "constraints.txt"),
        str(ROOT / "packages" / package),
    ]  # fmt: skip
    if importlib.util.find_spec("setuptools") is not None:
        # Our build backend is already here: skip building an isolated one (half the time).
        cmd.insert(cmd.index("--quiet"), "--no-build-isolation")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip could not resolve {package}:\n{proc.stderr[-3000:]}"
    data = json.loads(report.read_text())
    return {_canonical(item["metadata"]["name"]) for item in data["install"]}


@pytest.mark.slow
def test_parallel_alone_pulls_torch_and_nothing_of_ours_or_the_web(tmp_path: Path) -> None:
    names = resolve("parallel", tmp_path)
    assert "torch" in names
    assert names & OURS == {"nanotron-parallel"}
    assert not names & WEB_STACK, names & WEB_STACK


@pytest.mark.slow
def test_dashboard_alone_does_not_pull_torch(tmp_path: Path) -> None:
    names = resolve("dashboard", tmp_path)
    assert "torch" not in names
    assert names & OURS == {"nanotron-dashboard"}
    assert {"fastapi", "uvicorn", "sqlalchemy"} <= names  # the resolution really ran
