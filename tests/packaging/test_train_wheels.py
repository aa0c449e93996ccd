"""parallel + models + train wheels alone, in a fresh venv without the dashboard: they train."""

from __future__ import annotations

import json
import math

import pytest

from tests.packaging.packaging_helpers import ROOT, STEPS

VERSION = (ROOT / "VERSION").read_text().strip()


@pytest.mark.slow
def test_train_venv_runs_the_wheels_copies_and_lacks_the_dashboard(train_venv, tmp_path):
    out = train_venv.run(
        "import importlib.util as u, json, nanotron_parallel as p, nanotron_models as m,"
        " nanotron_train as t;"
        "print(json.dumps([p.__version__, [x.__file__ for x in (p, m, t)],"
        " [n for n in ('nanotron_dashboard', 'fastapi', 'uvicorn') if u.find_spec(n)]]))",
        cwd=tmp_path,
    )
    version, files, present = json.loads(out)
    assert version == VERSION
    assert all(f.startswith(str(train_venv.root)) for f in files), files
    assert present == []


@pytest.mark.slow
def test_train_wheels_alone_train_the_tiny_config_for_3_steps(tiny_losses_one_process):
    records = tiny_losses_one_process
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["consumed_tokens"] for r in records] == [512, 1024, 1536]  # 8 x 64 per step
    losses = [r["lm_loss"] for r in records]
    # A fresh model predicts about uniformly over its 256 tokens; the loss then goes down.
    assert abs(losses[0] - math.log(256)) < 0.2, losses
    assert losses[-1] < losses[0], losses
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)
