"""Nanotron's run-time keys: log levels per rank, a tokenizer revision in the local hub
cache, the dp replicas' sanity checks and the shared-file-system check, and the launcher's
user errors (one line, status 2)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_parallel.testing import shared_default_group
from nanotron_train.config import config_from_dict
from tests.train.nanotron_compat_helpers import tiny_config, train_records


@pytest.fixture(autouse=True)
def _default_group_per_test():
    """The trainers made here share one default group that is destroyed after each test, so no
    later test in the same process finds a group it did not make."""
    with shared_default_group():
        yield


def test_log_levels_per_rank(tmp_path, capfd):
    from nanotron_train.config.schema import LoggingArgs
    from nanotron_train.reporting.log_levels import configure_logging

    data = tiny_config()
    data["logging"] = {"log_level": "warning", "metrics_file": str(tmp_path / "m.jsonl")}
    out = io.StringIO()
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    train_records(Trainer(config_from_dict(data), ParallelContext(1, 1, 1), stream=out))
    assert out.getvalue() == ""  # step lines are info
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3
    data["logging"]["log_level"] = "info"
    train_records(Trainer(config_from_dict(data), ParallelContext(1, 1, 1), stream=out))
    assert out.getvalue().count("iteration: ") == 3
    import logging

    args = LoggingArgs(log_level="debug", log_level_replica="error")
    try:
        assert configure_logging(args, rank=1) == "error"
        assert logging.getLogger("nanotron_train").level == logging.ERROR
        logging.getLogger("nanotron_train.data").warning("hidden")
        assert configure_logging(args, rank=0) == "debug"
        logging.getLogger("nanotron_models.x").debug("shown")
        err = capfd.readouterr().err
        assert "[rank 0] DEBUG nanotron_models.x: shown" in err and "hidden" not in err
        assert configure_logging(LoggingArgs(log_level="passive"), rank=0) == "passive"
        assert logging.getLogger("nanotron_train").level == logging.DEBUG  # left alone
    finally:
        configure_logging(LoggingArgs(), rank=0)  # the default (info) for later tests


def test_tokenizer_revision_picks_that_snapshot_of_the_local_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from nanotron_train.data import DataError, load_tokenizer
    from nanotron_train.data.source import tokenizer_path
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    repo = tmp_path / "hub" / "models--org--tok"
    revs = {"a" * 40: 300, "b" * 40: 320}
    for rev, vocab in revs.items():
        make_tokenizer(repo / "snapshots" / rev, tiny_texts(), vocab_size=vocab)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_tokenizer("org/tok").vocab_size == 300  # main
    assert load_tokenizer("org/tok", "b" * 40).vocab_size == 320
    data = tiny_config()
    data["tokenizer"] = {"tokenizer_name_or_path": "org/tok", "tokenizer_revision": "b" * 40}
    assert tokenizer_path(config_from_dict(data).tokenizer) == str(
        repo / "snapshots" / ("b" * 40) / "tokenizer.json"
    )
    with pytest.raises(DataError, match="at revision 'c+'"):
        load_tokenizer("org/tok", "c" * 40)
    with pytest.raises(DataError, match="applies to hub names only"):
        load_tokenizer(str(repo / "snapshots" / ("a" * 40)), "main")


def _sanity_run(tmp: str) -> tuple[int, str, list[str]]:
    import os

    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.fault.sanity import SanityCheckError
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    data = tiny_config()
    data["general"]["ignore_sanity_checks"] = False
    data["parallelism"] = {"dp": 2}
    with shared_default_group():
        pc = ParallelContext(2, 1, 1)
        tr = Trainer(config_from_dict(data), pc, stream=io.StringIO())
        steps = [tr.train_step().step for _ in range(2)]  # replicas agree: no error
        if dist.get_rank() == 1:
            with torch.no_grad():
                dict(tr.state.model.named_parameters())["decoder.1.mlp.down.weight"][0, 0] += 1.0
        try:
            tr.train_step()
            message = ""
        except SanityCheckError as exc:
            message = str(exc)
        tr.close()
        # checkpoints_path_is_shared_file_system: true is checked: one folder seen by both
        # ranks passes; a relative path from different working directories is not shared.
        from nanotron_train.checkpoints import CheckpointError
        from nanotron_train.checkpoints.save import check_shared

        shared = []
        check_shared(Path(tmp) / "shared", pc)
        os.chdir(Path(tmp) / f"rank{dist.get_rank()}")
        try:
            check_shared(Path("ck"), pc)
        except CheckpointError as exc:
            shared.append(str(exc))
        pc.destroy()
    return len(steps), message, shared


def test_sanity_checks_and_shared_file_system_check(tmp_path):
    from nanotron_parallel.testing import run_distributed

    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    for steps, message, shared in run_distributed(_sanity_run, 2, str(tmp_path), timeout=120):
        assert steps == 2
        assert message == "step 3: dp replicas disagree on decoder.1.mlp.down.weight"
        assert shared == [
            "ck: checkpoints.checkpoints_path_is_shared_file_system is true but rank 1 does not "
            "see rank 0's files there"
        ]
    assert list((tmp_path / "shared").iterdir()) == []  # the marker is removed


def test_launcher_user_errors_are_one_line_and_status_2(tmp_path, capsys):
    """Under `python -m nanotron_train.launch` (torchrun inside) a config error is caught
    before any process starts, and a data error in the workers is still one line, status 2."""
    import os
    import subprocess
    import sys

    from nanotron_train.launch import main as launch

    data = tiny_config()
    data["parallelism"] = {"dp": 2}
    (tmp_path / "empty").mkdir()  # a folder, but no Nanoset: found by the workers' data path
    data["data_stages"][0]["data"]["dataset"] = {"dataset_folder": str(tmp_path / "empty")}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    assert launch(["--standalone", "--nproc_per_node=4", "--config-file", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}: parallelism: dp*tp*pp = 2*1*1 = 2 but the world size is 4\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "nanotron_train.launch", "--standalone", "--nproc_per_node=2",
         "--config-file", str(path)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: {tmp_path / 'empty' / 'metadata.json'}: missing Nanoset metadata "
        "(is this a Nanoset folder?)\n"
    )
