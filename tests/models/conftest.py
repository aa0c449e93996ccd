"""Model tests: make models_helpers importable (pytest runs in importlib mode) and share pc1."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pc1():
    """A world of one process (gloo, in this process), destroyed after the module."""
    from nanotron_parallel.context import ParallelContext

    torch.set_num_threads(1)
    pc = ParallelContext()
    yield pc
    pc.destroy()
