"""`make run` / `make stop` pieces: the background dashboard's start, reuse and stop, a port
held by something else, and the quickstart config's layout and command."""

from __future__ import annotations

import http.server
import os
import threading
from pathlib import Path

import pytest

from nanotron_train.config import load_config
from nanotron_train.quickstart import (
    CONFIG,
    DashboardFiles,
    QuickstartError,
    start_dashboard,
    stop_dashboard,
    train_command,
)
from tests.dashboard.dashboard_helpers import free_port

REPO = Path(__file__).resolve().parents[2]


def test_dashboard_started_once_reused_and_stopped(tmp_path):
    files = DashboardFiles(tmp_path / "runs.db", tmp_path / "d.pid", tmp_path / "d.log")
    port = free_port()
    url, started = start_dashboard(port, files)
    try:
        assert (url, started) == (f"http://127.0.0.1:{port}", True)
        pid = int(files.pid.read_text())
        assert files.db.is_file()
        assert start_dashboard(port, files) == (url, False)  # already answering: reused
        assert int(files.pid.read_text()) == pid
    finally:
        assert stop_dashboard(files) is True
    assert not files.pid.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert stop_dashboard(files) is False  # nothing left to stop


def test_port_held_by_another_program_is_one_clear_error(tmp_path):
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *a: None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        files = DashboardFiles(tmp_path / "runs.db", tmp_path / "d.pid", tmp_path / "d.log")
        with pytest.raises(QuickstartError, match=f"127.0.0.1:{server.server_port}"):
            start_dashboard(server.server_port, files)
        assert not files.pid.exists()
    finally:
        server.shutdown()
        server.server_close()


def test_quickstart_config_and_command():
    nanoset, tok = Path(".cache/data/x/nanoset"), Path(".cache/data/x/tokenizer")
    cmd = train_command(nanoset, tok, "http://127.0.0.1:8008", 4, None)
    assert cmd[1:5] == ["-m", "nanotron_train.launch", "--standalone", "--nproc_per_node=4"]
    overrides = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--override"]
    assert overrides == [
        f"data_stages.0.data.dataset.dataset_folder={nanoset}",
        f"tokenizer.tokenizer_name_or_path={tok}",
        "logging.dashboard_url=http://127.0.0.1:8008",
    ]
    cfg = load_config(str(REPO / CONFIG), overrides, world_size=4)
    par = cfg.parallelism
    assert (par.dp, par.tp, par.pp) == (2, 1, 2)  # two parallel dimensions at once
    assert cfg.model.model_config.vocab_size >= 4096  # the default corpus's BPE
    assert cfg.logging.dashboard_url == "http://127.0.0.1:8008"
    assert cfg.data_stages[0].data.dataset.dataset_folder == [str(nanoset)]


def test_a_dashboard_this_folder_did_not_start_is_refused_not_streamed_into(tmp_path):
    """Another clone's dashboard on the port: refused with the way out (PORT=); ours: reused."""
    import subprocess
    import time

    from nanotron_train.quickstart import _dashboard_program, dashboard_answers

    ours = DashboardFiles(tmp_path / "runs.db", tmp_path / "d.pid", tmp_path / "d.log")
    url, started = start_dashboard(free_port(), ours)
    other_port = free_port()
    foreign = subprocess.Popen(
        [*_dashboard_program(), "--db", str(tmp_path / "other.db"), "--port", str(other_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not dashboard_answers(f"http://127.0.0.1:{other_port}"):
            assert foreign.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        with pytest.raises(QuickstartError) as err:
            start_dashboard(other_port, ours)
        message = str(err.value)
        assert f"127.0.0.1:{other_port} is a nanotron dashboard that `make run`" in message
        assert f"`make run PORT={other_port + 2}`" in message and "\n" not in message
        assert start_dashboard(int(url.rsplit(":", 1)[1]), ours) == (url, False)  # ours
    finally:
        foreign.terminate()
        foreign.wait(timeout=30)
        assert stop_dashboard(ours) is True


def test_next_steps_are_runnable_commands_with_this_runs_paths(tmp_path, monkeypatch):
    import shlex
    import sys

    from nanotron_train.evaluate import parse_args as evaluate_args
    from nanotron_train.generate import parse_args as generate_args
    from nanotron_train.quickstart import next_steps

    monkeypatch.chdir(REPO)
    nanoset, tok = tmp_path / "nanoset", tmp_path / "tokenizer"
    text = next_steps(nanoset, tok, "http://127.0.0.1:8010", 4, 300)
    lines = [line.strip() for line in text.splitlines()]
    venv = Path(sys.prefix)
    shown_venv = venv.relative_to(REPO) if venv.is_relative_to(REPO) else venv
    assert lines[1].startswith(f"source {shown_venv}/bin/activate")
    commands = [shlex.split(line) for line in lines if line.startswith("python -m")]
    gen, ev, resume = commands
    ckpts = str(REPO / "checkpoints" / "quickstart")
    assert generate_args(gen[3:]).ckpt_path == ckpts
    args = evaluate_args(ev[3:])
    assert (args.ckpt_path, args.dataset_folder) == (ckpts, [str(nanoset)])
    assert resume[:3] == ["python", "-m", "nanotron_train.launch"]
    assert resume[-2:] == ["--resume", "latest"]
    overrides = [resume[i + 1] for i, a in enumerate(resume) if a == "--override"]
    cfg = load_config(str(REPO / CONFIG), overrides, world_size=4)
    assert cfg.tokens.train_steps == 600 and cfg.logging.dashboard_url == "http://127.0.0.1:8010"
    assert cfg.data_stages[0].data.dataset.dataset_folder == [str(nanoset)]
    assert lines[-1].startswith("# the runs, their charts and checkpoints: http://127.0.0.1:8010")
