"""`make run` and `make stop`: the quickstart, from a fresh clone to a run on the dashboard.

    python -m nanotron_train.quickstart run [--port 8008] [--steps N] [--nproc 4]
    python -m nanotron_train.quickstart stop

`run` prepares the default corpus once (the stdlib's source, cached under .cache/data), starts
the dashboard in the background unless the one it started before still answers on the port
(pid file and log under .cache/), then trains configs/quickstart-cpu.yaml with torchrun,
streaming to the dashboard, and prints the next steps (generate, evaluate, resume) with this
run's paths. A dashboard on the port that this folder's `make run` did not start (another
clone's, another user's) is refused, not streamed into: `make run PORT=...` picks another.
The dashboard keeps running afterwards so the run can be browsed; `stop` ends it.
The dashboard is started as a program, never imported: nanotron_train does not depend on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from nanotron_train.launching.port_owner import holds_port

CACHE = Path(".cache")
CONFIG = Path("configs/quickstart-cpu.yaml")


class QuickstartError(ValueError):
    """Something `make run` cannot work around (port taken, dashboard failing to start)."""


@dataclass
class DashboardFiles:
    db: Path = CACHE / "runs.db"
    pid: Path = CACHE / "dashboard.pid"
    log: Path = CACHE / "dashboard.log"


def dashboard_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def dashboard_answers(url: str, timeout: float = 1.0) -> bool:
    """True when a nanotron dashboard answers at `url`; QuickstartError when something else does."""
    try:
        with urllib.request.urlopen(url + "/api/session", timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        if e.code == 401:  # a dashboard started with --token: ours is not, so it is someone else's
            raise QuickstartError(
                f"{url} is a dashboard that needs a token; stop it or use `make run PORT=...`"
            ) from None
        raise QuickstartError(
            f"{url} answers but is not a nanotron dashboard (HTTP {e.code}); "
            "free the port or use `make run PORT=...`"
        ) from None
    except (OSError, ValueError):
        return False
    try:
        json.loads(body)
    except ValueError:
        raise QuickstartError(
            f"{url} answers but is not a nanotron dashboard; free the port or use `make run PORT=...`"
        ) from None
    return True


def _dashboard_program() -> list[str]:
    script = Path(sys.executable).parent / "nanotron-dashboard"
    return [str(script)] if script.exists() else [sys.executable, "-m", "nanotron_dashboard"]


def start_dashboard(port: int, files: DashboardFiles, timeout: float = 60.0) -> tuple[str, bool]:
    """Start the dashboard in the background unless ours already answers; returns (url, started)."""
    url = dashboard_url(port)
    if dashboard_answers(url):
        if not _ours_on(port, files):
            raise QuickstartError(
                f"{url} is a nanotron dashboard that `make run` in {Path.cwd()} did not start "
                "(another clone's or another user's?): this run would land in its database. "
                f"Use another port, e.g. `make run PORT={_suggested_port(port)}`, or stop it"
            )
        return url, False
    files.db.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*_dashboard_program(), "--db", str(files.db), "--host", "127.0.0.1", "--port", str(port)]
    with open(files.log, "ab") as log:
        # A session of its own: Ctrl-C in `make run` stops the training, not the dashboard.
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    files.pid.write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            files.pid.unlink(missing_ok=True)
            tail = files.log.read_text(errors="replace").strip().splitlines()[-5:]
            raise QuickstartError(
                f"the dashboard exited with status {proc.returncode}; {files.log} ends with:\n"
                + "\n".join(tail)
            )
        if dashboard_answers(url):
            return url, True
        time.sleep(0.2)
    stop_dashboard(files)
    raise QuickstartError(f"the dashboard did not answer at {url} within {timeout:.0f} s")


def _ours_on(port: int, files: DashboardFiles) -> bool:
    """Whether what listens on `port` is the dashboard whose pid `run` recorded."""
    try:
        pid = int(files.pid.read_text().strip())
    except (OSError, ValueError):
        return False
    if not _is_dashboard(pid):
        return False
    held = holds_port(pid, port)
    return held is None or held  # no /proc to ask: our live dashboard is taken at its word


def _suggested_port(port: int) -> int:
    return port + 2 if port < 65533 else 8010


def _is_dashboard(pid: int) -> bool:
    """The pid file may be stale and the pid reused: only signal our dashboard."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        try:
            os.kill(pid, 0)  # no /proc (macOS): trust the pid file if the process exists
        except OSError:
            return False
        return True
    return b"nanotron-dashboard" in cmdline or b"nanotron_dashboard" in cmdline


def stop_dashboard(files: DashboardFiles, timeout: float = 10.0) -> bool:
    """Stop the dashboard started by `run`; False when none was running."""
    try:
        pid = int(files.pid.read_text().strip())
    except (OSError, ValueError):
        return False
    running = _is_dashboard(pid)
    if running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout  # and reap it, so no zombie keeps its pid
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
    files.pid.unlink(missing_ok=True)
    return running


def _alive(pid: int) -> bool:
    """Whether `pid` still exists. Our own child is reaped here once it exits (else it would
    linger as a zombie); another process's is reaped by its parent or init."""
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def train_command(
    nanoset: Path, tokenizer: Path, url: str, nproc: int, steps: int | None
) -> list[str]:
    """The quickstart's launch (the launcher's form: one-line errors, a preemption exits 0);
    its dashboard records it for resuming."""
    cmd = [
        sys.executable,
        "-m",
        "nanotron_train.launch",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--config-file",
        str(CONFIG),
        "--override",
        f"data_stages.0.data.dataset.dataset_folder={nanoset}",
        "--override",
        f"tokenizer.tokenizer_name_or_path={tokenizer}",
        "--override",
        f"logging.dashboard_url={url}",
    ]
    if steps is not None:
        cmd += ["--override", f"tokens.train_steps={steps}"]
    return cmd


def next_steps(nanoset: Path, tokenizer: Path, url: str, nproc: int, steps: int) -> str:
    """What to do with the trained model, as commands with this run's absolute paths."""
    import yaml

    ckpts = Path(yaml.safe_load(CONFIG.read_text())["checkpoints"]["checkpoints_path"]).resolve()
    venv = Path(sys.prefix)
    venv = venv.relative_to(Path.cwd()) if venv.is_relative_to(Path.cwd()) else venv
    overrides = " ".join(
        f"--override {a}"
        for a in (
            f"data_stages.0.data.dataset.dataset_folder={nanoset}",
            f"tokenizer.tokenizer_name_or_path={tokenizer}",
            f"logging.dashboard_url={url}",
            f"tokens.train_steps={2 * steps}",
        )
    )
    return "\n".join(
        [
            "== next steps (from this folder):",
            f"   source {venv}/bin/activate   # the virtual environment of `make run`",
            "   # continue the prompt with the trained model:",
            f"   python -m nanotron_train.generate --ckpt-path {ckpts} --prompt 'def read_config(' "
            "--max-new-tokens 64",
            "   # its loss and perplexity on tokenized text (here, the training corpus):",
            f"   python -m nanotron_train.evaluate --ckpt-path {ckpts} --dataset-folder {nanoset} "
            "--limit-batches 8",
            f"   # train on from the last checkpoint, to step {2 * steps}:",
            f"   python -m nanotron_train.launch --standalone --nproc_per_node={nproc} "
            f"--config-file {CONFIG} {overrides} --resume latest",
            f"   # the runs, their charts and checkpoints: {url}   (`make stop` stops it)",
        ]
    )


def run(port: int, nproc: int, steps: int | None) -> int:
    from nanotron_train.data.corpus import prepare_default_corpus

    print("== preparing the default corpus (the Python stdlib's source; cached in .cache/data)")
    tokenizer, nanoset = prepare_default_corpus(str(CACHE / "data"))
    tokenizer, nanoset = tokenizer.resolve(), nanoset.resolve()  # the checkpoint works anywhere
    print(f"   tokenizer: {tokenizer}\n   nanoset:   {nanoset}")
    url, started = start_dashboard(port, DashboardFiles())
    how = "started in the background" if started else "already running"
    print(f"== dashboard {how}: {url}   (open it in a browser; `make stop` stops it)")
    cmd = train_command(nanoset, tokenizer, url, nproc, steps)
    print("== training (dp=2 x pp=2 on 4 CPU processes):\n   " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        code = subprocess.run(cmd, env=env).returncode
    except KeyboardInterrupt:
        code = 130
    minutes = (time.perf_counter() - t0) / 60
    state = "finished" if code == 0 else f"stopped (exit status {code})"
    print(f"== training {state} after {minutes:.1f} min; the run is on {url}", flush=True)
    if code == 0:
        import yaml

        total = steps or yaml.safe_load(CONFIG.read_text())["tokens"]["train_steps"]
        print(next_steps(nanoset, tokenizer, url, nproc, total), flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanotron_train.quickstart", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="prepare data, start the dashboard, train the tiny Llama")
    r.add_argument("--port", type=int, default=8008)
    r.add_argument("--nproc", type=int, default=4, help="processes (the config wants dp*pp=4)")
    r.add_argument("--steps", type=int, default=None, help="override tokens.train_steps")
    sub.add_parser("stop", help="stop the dashboard started by `run`")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="   %(message)s")  # the corpus's progress
    try:
        if args.command == "stop":
            stopped = stop_dashboard(DashboardFiles())
            print(
                "dashboard stopped" if stopped else "no dashboard started by `make run` is running"
            )
            return 0
        return run(args.port, args.nproc, args.steps)
    except ValueError as e:  # QuickstartError, DataError: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
