"""Small pieces of the trainer: LR schedule, synthetic data, config round trip, presets."""

from __future__ import annotations

import math

import pytest

from nanotron_train.config import ConfigError, load_config, save_config
from nanotron_train.config.loader import apply_override
from nanotron_train.data.synthetic import SyntheticData
from nanotron_train.init_config import main as init_main
from nanotron_train.lr_schedule import LRSchedule


def sched(warmup_style="linear", decay_style="cosine") -> LRSchedule:
    return LRSchedule(1.0, 4, warmup_style, decay_style, decay_start=4, decay_steps=10, min_lr=0.1)


def test_lr_schedule_values():
    s = sched()
    assert [s(k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(14) == pytest.approx(0.1) and s(100) == 0.1
    assert sched("constant")(1) == 1.0
    assert sched(decay_style="linear")(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert sched(decay_style="1-sqrt")(9) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)))


def test_synthetic_global_batch_independent_of_dp():
    def global_batch(dp: int, steps: int) -> list[list[int]]:
        rows = []
        ranks = [SyntheticData(3, 8, 50, 2, 4 // dp, dp, r) for r in range(dp)]
        for step in range(1, steps + 1):
            for data in ranks:
                for mb in data.micro_batches(step):
                    rows += mb["input_ids"].tolist()
        return rows

    one = global_batch(1, 2)
    assert one == global_batch(2, 2) == global_batch(4, 2)
    assert len(one) == 16 and len({tuple(r) for r in one}) >= 14  # distinct samples
    data = SyntheticData(3, 8, 50, 2, 2, 1, 0)
    data.micro_batches(1)
    state = data.state_dict()
    nxt = data.micro_batches(2)[0]["input_ids"]
    data.load_state_dict(state)
    assert data.micro_batches(2)[0]["input_ids"].equal(nxt)


def test_presets_round_trip(tmp_path):
    for preset in ("tiny-llama", "llama-1b"):
        out = tmp_path / f"{preset}.yaml"
        assert init_main(["--preset", preset, "--out", str(out)]) == 0
        cfg = load_config(out)
        save_config(cfg, tmp_path / "again.yaml")
        assert load_config(tmp_path / "again.yaml") == cfg
    tiny = load_config(tmp_path / "tiny-llama.yaml", ["parallelism.dp=2"], world_size=2)
    assert tiny.parallelism.dp == 2 and tiny.global_batch_size == 16


def test_presets_are_the_shipped_configs():
    """`init_config --preset X` writes the config that configs/ ships for X."""
    from pathlib import Path

    from nanotron_train.config import config_from_dict
    from nanotron_train.init_config import PRESETS

    root = Path(__file__).resolve().parents[2] / "configs"
    shipped = {"tiny-llama": "tiny-llama-cpu.yaml", "llama-1b": "llama-1b-gpu.yaml"}
    assert sorted(shipped) == sorted(PRESETS)
    for preset, name in shipped.items():
        assert load_config(root / name) == config_from_dict(PRESETS[preset], preset), name


def test_override_into_list_and_errors():
    data = {"data_stages": [{"name": "a", "data": {"seed": 1}}]}
    apply_override(data, "data_stages.0.data.seed=5")
    assert data["data_stages"][0]["data"]["seed"] == 5
    with pytest.raises(ConfigError, match="data_stages.3"):
        apply_override(data, "data_stages.3.name=x")
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_override(data, "tokens")
