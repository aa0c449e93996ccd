"""Numbers and paths a config holds: non-finite floats, integers beyond 64 bits, seeds out of
range and paths of the wrong kind are refused at load, in one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanotron_train.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny-llama-cpu.yaml")
LR = "optimizer.learning_rate_scheduler.learning_rate"

REFUSED = {
    f"{LR}=.inf": (LR, "must be a finite number, got inf"),
    f"{LR}=-.inf": (LR, "must be a finite number, got -inf"),
    f"{LR}=1e400": (LR, "must be a finite number, got inf"),
    "model.model_config.rope_theta=.nan": ("model.model_config.rope_theta", "finite number, got nan"),
    "optimizer.clip_grad=.inf": ("optimizer.clip_grad", "must be a finite number, got inf"),
    "parallelism.collective_timeout_s=.inf": ("parallelism.collective_timeout_s", "finite"),
    "model.model_config.rope_scaling={rope_type: llama3, factor: .nan}": (
        "model.model_config.rope_scaling.factor", "must be a finite number, got nan"
    ),
    "fault_tolerance.loss_spike_zscore=.nan": ("fault_tolerance.loss_spike_zscore", "finite"),
    f"general.seed={2**70}": ("general.seed", f"must fit in 64 bits (at most 2**63-1), got {2**70}"),
    "general.seed=-1": ("general.seed", "must be in [0, 9223372036854775807]"),
    f"tokens.train_steps={2**64}": ("tokens.train_steps", "must fit in 64 bits"),
    f"data_stages.0.data.seed={2**32}": ("data_stages.0.data.seed", "must be in [0, 4294967295]"),
    "optimizer.learning_rate_scheduler.min_decay_lr=-1e-4": (
        "optimizer.learning_rate_scheduler.min_decay_lr", "must be >= 0 or null, got -0.0001"
    ),
}  # fmt: skip


@pytest.mark.parametrize("override", list(REFUSED))
def test_value_refused_naming_the_key(override):
    key, message = REFUSED[override]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert err.value.key == key and message in err.value.detail, str(err.value)


def test_paths_of_the_wrong_kind(tmp_path):
    folder, file = tmp_path / "d", tmp_path / "f"
    folder.mkdir()
    file.write_text("")
    cases = {
        f"logging.metrics_file={folder}": ("logging.metrics_file", f"{folder} is a folder"),
        f"logging.metrics_file={file}/m.jsonl": ("logging.metrics_file", f"{file} is not a folder"),
        f"general.benchmark_csv_path={folder}": ("general.benchmark_csv_path", "is a folder"),
        f"logging.tensorboard_dir={file}": ("logging.tensorboard_dir", f"{file} is a file"),
        f"checkpoints.checkpoints_path={file}": ("checkpoints.checkpoints_path", "is a file"),
    }
    for override, (key, message) in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(TINY, [override])
        assert err.value.key == key and message in err.value.detail, str(err.value)
    ok = load_config(
        TINY, [f"logging.metrics_file={folder}/new.jsonl", f"general.seed={2**63 - 1}"]
    )
    assert ok.logging.metrics_file == f"{folder}/new.jsonl" and ok.general.seed == 2**63 - 1


def test_cli_one_line(tmp_path, capsys):
    from nanotron_train.__main__ import main

    text = Path(TINY).read_text().replace("learning_rate: 0.003", "learning_rate: .inf")
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["--config-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: {LR}: must be a finite number, got inf\n"
