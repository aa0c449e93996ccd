"""Session fixtures: the four packages built once, and two fresh venvs made from the wheels.

One venv holds only the dashboard (no torch), the other parallel + models + train (no dashboard).
"""

from __future__ import annotations

import shutil

import pytest

from tests.packaging.packaging_helpers import Built, build_all, make_venv, train_tiny


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    return build_all(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="session")
def dashboard_venv(built: dict[str, Built], tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("venv-dashboard")
    yield make_venv(root / "venv", [built["dashboard"].wheel])
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def train_venv(built: dict[str, Built], tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("venv-train")
    wheels = [built[p].wheel for p in ("parallel", "models", "train")]
    yield make_venv(root / "venv", wheels)
    shutil.rmtree(root, ignore_errors=True)  # about 1 GB, mostly torch


@pytest.fixture(scope="session")
def tiny_losses_one_process(train_venv, tmp_path_factory: pytest.TempPathFactory):
    """Per-step records of configs/tiny-llama-cpu.yaml, 3 steps, one process, from the wheels."""
    return train_tiny(train_venv, tmp_path_factory.mktemp("train-1proc"))
