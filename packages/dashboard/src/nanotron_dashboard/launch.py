"""Starting a resume from a listed checkpoint: the stored command, the stored cwd, no shell.

One launch per checkpoint at a time (a double click, or three parallel POSTs, start one
trainer, not three), and every child is reaped by a waiting thread as soon as it exits.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .checkpoints import resume_argv
from .errors import DashboardError


class LaunchError(DashboardError):
    pass


class AlreadyRunning(DashboardError):
    """A launch of this checkpoint is still running (HTTP 409)."""


@dataclass
class Launched:
    pid: int
    argv: list[str]
    cwd: str
    log: str


class Launcher:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._lock = threading.Lock()
        self._running: dict[int, subprocess.Popen] = {}  # checkpoint id -> child

    def running(self, checkpoint_id: int) -> bool:
        with self._lock:
            proc = self._running.get(checkpoint_id)
            return proc is not None and proc.poll() is None

    def launch(
        self,
        checkpoint_id: int,
        command: list[str],
        cwd: str | None,
        checkpoint_path: str,
        env_extra: dict[str, str],
    ) -> Launched:
        with self._lock:  # check and start under one lock: parallel requests start one child
            prev = self._running.get(checkpoint_id)
            if prev is not None and prev.poll() is None:
                raise AlreadyRunning(
                    f"checkpoint {checkpoint_id} was already launched (pid {prev.pid}) and that "
                    "launch still runs"
                )
            launched, proc = _start(command, cwd, checkpoint_path, self.log_dir, env_extra)
            self._running[checkpoint_id] = proc
        threading.Thread(target=self._reap, args=(checkpoint_id, proc), daemon=True).start()
        return launched

    def _reap(self, checkpoint_id: int, proc: subprocess.Popen) -> None:
        proc.wait()  # no zombie: the exit status is collected as soon as the child ends
        with self._lock:
            if self._running.get(checkpoint_id) is proc:
                del self._running[checkpoint_id]


def _start(
    command: list[str],
    cwd: str | None,
    checkpoint_path: str,
    log_dir: Path,
    env_extra: dict[str, str],
) -> tuple[Launched, subprocess.Popen]:
    if not command:
        raise LaunchError("this run recorded no command line, so it cannot be resumed from here")
    if not cwd or not Path(cwd).is_dir():
        raise LaunchError(f"the run's working directory {cwd!r} does not exist on this machine")
    argv = resume_argv(command, checkpoint_path)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"resume-{time.time_ns()}.log"
    env = {**os.environ, **env_extra}
    with open(log_path, "ab") as log:
        try:
            proc = subprocess.Popen(  # noqa: S603 - argv from the database, never from the request
                argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as e:
            raise LaunchError(f"could not start {argv[0]!r}: {e}") from None
    return Launched(pid=proc.pid, argv=argv, cwd=cwd, log=str(log_path)), proc
