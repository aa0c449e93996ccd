"""`parallelism: auto` and `--auto`: a run takes the layout the planner ranks first for its
world size, prints why, and trains exactly as that layout given explicitly; when nothing fits,
every rank (and the launcher, before starting any) stops with the same one line, status 2."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from nanotron_parallel.testing import run_distributed, shared_default_group
from nanotron_train.config import load_config
from nanotron_train.config.errors import ConfigError
from nanotron_train.plan.auto import choose, describe, local_device
from nanotron_train.plan.cli import flags
from tests.train.test_cli import small_config


def _train_both(auto_cfg: str, explicit_cfg: str, explicit: list[str], out: str) -> str:
    """One launch: the auto run, then the explicit layout; rank 0's stdout."""
    from nanotron_train.__main__ import main

    buf = io.StringIO()
    with shared_default_group(), contextlib.redirect_stdout(buf):
        auto = ["--override", f"logging.metrics_file={out}/auto.jsonl"]
        assert main(["--config-file", auto_cfg, *auto]) == 0
        given = ["--override", f"logging.metrics_file={out}/explicit.jsonl"]
        assert main(["--config-file", explicit_cfg, *explicit, *given]) == 0
    return buf.getvalue()


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["lm_loss"] for line in path.read_text().splitlines()]


def _configs(tmp_path: Path) -> tuple[Path, Path]:
    data = small_config(tmp_path, tokens__train_steps=2, checkpoints__checkpoints_path=None)
    data["tokens"].update(micro_batch_size=2, batch_accumulation_per_replica=2)
    explicit = tmp_path / "explicit.yaml"
    explicit.write_text(yaml.safe_dump(data))
    auto = tmp_path / "auto.yaml"
    auto.write_text(yaml.safe_dump({**data, "parallelism": "auto"}))
    return auto, explicit


def test_auto_trains_the_planner_s_first_layout_as_given_explicitly(tmp_path):
    auto, explicit = _configs(tmp_path)
    cfg = load_config(auto)
    assert cfg.parallelism.auto and cfg.global_batch_size == 4
    fits, _ = choose(cfg, 2, 2, local_device(2))  # the children see 2 ranks on this host
    paste = flags(fits[0], load_config(explicit)).split()
    assert paste[0] == "--override"  # a layout of 2 ranks: not the config's own
    assert load_config(explicit, paste[1::2], world_size=2).parallelism.auto is False
    out = run_distributed(_train_both, 2, str(auto), str(explicit), paste, str(tmp_path))[0]
    lines = out.splitlines()
    assert lines[0].startswith("parallelism: auto: 2 ranks on cpu (")
    assert f": {len(fits)} of " in lines[0] and lines[0].endswith("chose the fastest predicted")
    assert lines[1] == f"  chosen:    {describe(fits[0])}"
    assert lines[2].startswith("  predicted: peak ") and " step " in lines[2]
    assert lines[3].startswith(f"  runner-up: {describe(fits[1])}: step ")
    assert out.count("parallelism: auto") == 1  # rank 0 only, once
    losses = _losses(tmp_path / "auto.jsonl")
    assert len(losses) == 2 and losses == _losses(tmp_path / "explicit.jsonl")


def _too_big(tmp_path: Path) -> Path:
    """~1.4e12 parameters: no layout of 2 ranks holds its states on any host or GPU."""
    data = small_config(tmp_path)
    data["model"]["model_config"].update(
        hidden_size=16384, intermediate_size=65536, num_hidden_layers=400,
        num_attention_heads=128, num_key_value_heads=8, vocab_size=131072,
    )  # fmt: skip
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--auto"], "with --auto"),  # --auto alone: no --override to name
        (["--override", "tokens.train_steps=3", "--auto"], "with --override, --auto"),
    ],
)
def test_nothing_fits_is_one_line_on_every_rank_and_from_the_launcher(
    tmp_path, monkeypatch, capsys, given, named
):
    """The line names the flags the user gave, and only those."""
    from nanotron_train import __main__ as entry
    from nanotron_train import launch

    big = str(_too_big(tmp_path))
    with pytest.raises(ConfigError) as refused:  # the planner's own words for this model
        choose(load_config(big, ["parallelism.auto=true"]), 2, 2, local_device(2))
    expected = f"error: {big} ({named}): parallelism: {refused.value.detail}"
    assert " layouts of 2 ranks fits " in expected and "needs " in expected
    assert "\n" not in expected
    reported: list[str] = []
    monkeypatch.setattr(entry, "_report", reported.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert entry.main(["--config-file", big, *given]) == 2
    assert reported == [expected, expected]
    capsys.readouterr()
    monkeypatch.delenv("RANK")
    assert launch.main(["--nproc_per_node=2", "--config-file", big, *given]) == 2
    captured = capsys.readouterr()
    assert captured.err == expected + "\n" and captured.out == ""


@pytest.mark.parametrize("text", ["parallelism: auto", "parallelism: AUTO"])
def test_auto_in_the_yaml_is_the_flag(tmp_path, text):
    data = small_config(tmp_path)
    del data["parallelism"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data) + text + "\n")
    cfg = load_config(path, world_size=4)  # no world-size check before the choice
    assert cfg.parallelism.auto and cfg.parallelism.dp == 1
    flagged = load_config(tmp_path / "c.yaml", ["parallelism.auto=false"])
    assert not flagged.parallelism.auto
