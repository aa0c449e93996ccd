"""Starting a resume from a listed checkpoint: the granted command, its cwd, no shell.

What may run is decided by the database, never by the request: a run's launch grant holds the
command, cwd and checkpoints path that a trainer holding the launch token sent in its
run_start, and the checkpoint must lie inside that checkpoints path.

One launch per checkpoint at a time (a double click, or three parallel POSTs, start one
trainer, not three), and every child is reaped by a waiting thread as soon as it exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import Connection

from .checkpoints import newest_complete_step, resolve_dir, resume_argv
from .errors import DashboardError
from .messages import RunStart


class LaunchError(DashboardError):
    pass


class AlreadyRunning(DashboardError):
    """A launch of this checkpoint is still running (HTTP 409)."""


class NotGranted(DashboardError):
    """This run or checkpoint may not be launched (HTTP 403)."""


def grant_job(m: RunStart) -> object:
    """A writer job, queued after a run_start sent with the launch token: grant that run's
    command if the stored one is the one this trainer sent (a refused 409 grants nothing)."""
    sent = (json.dumps(m.command), m.cwd, m.checkpoints_path)

    def job(conn: Connection) -> bool:
        row = conn.exec_driver_sql(
            "SELECT pk, command, cwd, checkpoints_path FROM runs WHERE id=?", (m.run_id,)
        ).first()
        if row is None or tuple(row[1:]) != sent or not m.command:
            return False
        conn.exec_driver_sql(
            "INSERT INTO launch_grants(run_pk, command, cwd, checkpoints_path) "
            "VALUES (?, ?, ?, ?) ON CONFLICT(run_pk) DO UPDATE SET command=excluded.command, "
            "cwd=excluded.cwd, checkpoints_path=excluded.checkpoints_path",
            (row[0], *sent),
        )
        return True

    return job


@dataclass
class Plan:
    run_id: str
    command: list[str]
    cwd: str | None
    checkpoint: str


def plan(conn: Connection, checkpoint_id: int) -> Plan | None:
    """What resuming this checkpoint runs; None if no such checkpoint, NotGranted if barred."""
    row = conn.exec_driver_sql(
        "SELECT c.path, r.id, g.command, g.cwd, g.checkpoints_path FROM checkpoints c "
        "JOIN runs r ON r.pk=c.run_pk LEFT JOIN launch_grants g ON g.run_pk=c.run_pk "
        "WHERE c.id=?",
        (checkpoint_id,),
    ).first()
    if row is None:
        return None
    path, run_id, command, cwd, ck_root = row
    if command is None:
        raise NotGranted(
            f"run {run_id!r} may not be launched from here: its run_start was not sent with "
            "the launch token"
        )
    if not ck_root:
        raise NotGranted(f"run {run_id!r} recorded no checkpoints path to resume from")
    try:
        inside = (
            resolve_dir(path, cwd).resolve().is_relative_to(resolve_dir(ck_root, cwd).resolve())
        )
    except (OSError, ValueError, RuntimeError):
        inside = False
    if not inside:
        raise NotGranted(
            f"checkpoint {checkpoint_id} ({path}) is not inside run {run_id!r}'s checkpoints "
            f"path {ck_root}"
        )
    return Plan(run_id, json.loads(command), cwd, path)


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
    argv = resume_argv(command, checkpoint_path, newest_complete_step(Path(checkpoint_path).parent))
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
