"""Under plain `torchrun --nproc_per_node=8 -m nanotron_train --config-file bad.yaml` a config
error is printed once, every time, whichever rank stops first (launching/first_report.py): an
unknown key launched with local rank 0 held back (another rank surely exits first and torchrun
stops rank 0: where rank 0 alone printed, the line was lost every time) and launched as is (any
rank may exit first). The kinds of error (an unknown key, a wrong type, an unknown pp_engine)
share one path, the config's load before any rank starts work and then the one report those
launches exercise, so each kind is checked in this process through the same `main` (one line,
exit status 2, no traceback) instead of a launch each, 8 processes' start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.train.test_cli import small_config

REPO = Path(__file__).resolve().parents[2]


def _unknown_key(data: dict) -> str:
    data["general"]["bogus"] = 1
    return "general.bogus: unknown key (allowed here: "


def _wrong_type(data: dict) -> str:
    data["tokens"]["sequence_length"] = "long"
    return "tokens.sequence_length: expected an integer, got str 'long'"


def _unknown_engine(data: dict) -> str:
    data["parallelism"]["pp_engine"] = "zigzag"
    return "parallelism.pp_engine: must be one of ['afab', '1f1b', "


def torchrun(module: str, config: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "NANOTRON_"))}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8",
         "-m", module, "--config-file", str(config)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def check_printed_once(tmp_path: Path, make_error, module: str) -> None:
    data = small_config(tmp_path, parallelism__dp=8)
    expected = make_error(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    line = f"error: {path}: {expected}"
    proc = torchrun(module, path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]  # torchrun's status for a failed worker
    assert output.count(f"error: {path}:") == 1, f"{module}:\n{output[-3000:]}"
    assert line in output
    assert "exitcode: 2" in output  # the first worker to exit exited with the user error
    assert 'File "' + str(REPO / "packages") not in output  # no traceback of ours


@pytest.mark.slow
def test_config_error_is_printed_once_with_rank_0_held_back(tmp_path):
    check_printed_once(tmp_path, _unknown_key, "tests.train.staggered_main")


@pytest.mark.parametrize("make_error", [_unknown_key, _wrong_type, _unknown_engine])
def test_each_kind_of_config_error_is_one_line_from_main(tmp_path, capsys, monkeypatch, make_error):
    from nanotron_train.__main__ import main

    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    data = small_config(tmp_path, parallelism__dp=8)
    expected = make_error(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["--config-file", str(path)]) == 2  # raised nothing: no traceback
    err = capsys.readouterr().err
    assert err.count(f"error: {path}:") == 1 and f"error: {path}: {expected}" in err, err


@pytest.mark.slow
def test_config_error_is_printed_once_whichever_rank_exits_first(tmp_path):
    check_printed_once(tmp_path, _unknown_key, "nanotron_train")


def test_a_marker_folder_that_is_not_private_never_hides_the_line(tmp_path, monkeypatch, capsys):
    """The node's marker folder in the temporary folder may have been made first by someone
    else (or left loose): its markers are then not trusted and the line is printed."""
    from nanotron_train.launching import first_report

    monkeypatch.setattr(first_report.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    folder = tmp_path / f"nanotron-train-errors-{os.getuid()}"
    folder.mkdir(mode=0o700)
    (folder / first_report._launch_key()).write_bytes(b"printed")  # a sibling printed it
    first_report.report_first("error: once")
    assert capsys.readouterr().err == ""
    folder.chmod(0o777)  # a loose folder (as another user's would be): its marker may be forged
    first_report.report_first("error: once")
    assert capsys.readouterr().err == "error: once\n"
