"""Starting a resume from a listed checkpoint: the granted command, its cwd, no shell.

What may run is decided by the database, never by the request: a run's launch grant holds the
command, cwd and checkpoints path that a trainer holding the launch token sent in its
run_start, signed with a key only the launch token gives (grants.py) and verified before each
launch, and the checkpoint must lie inside that checkpoints path. The launch logs are private:
their folder 0700, each log 0600 (db_files.private_dir).

One launch per checkpoint at a time (a double click, or three parallel POSTs, start one
trainer, not three), and every child is reaped by a waiting thread as soon as it exits.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import Connection

from .checkpoints import newest_complete_step, resume_argv
from .db_files import private_dir
from .errors import DashboardError, DatabaseFileError
from .grants import GrantSigner, tampered
from .paths import is_inside

log = logging.getLogger("nanotron_dashboard")


class LaunchError(DashboardError):
    pass


class AlreadyRunning(DashboardError):
    """A launch of this checkpoint is still running (HTTP 409)."""


class NotGranted(DashboardError):
    """This run or checkpoint may not be launched (HTTP 403)."""


@dataclass
class Plan:
    run_id: str
    command: list[str]
    cwd: str | None
    checkpoint: str


def plan(conn: Connection, checkpoint_id: int, signer: GrantSigner) -> Plan | None:
    """What resuming this checkpoint runs; None if no such checkpoint, NotGranted if barred
    (no grant, a grant that does not verify, a checkpoint outside its checkpoints path)."""
    row = conn.exec_driver_sql(
        "SELECT c.path, r.id, r.command, r.cwd, r.checkpoints_path, g.command, g.cwd, "
        "g.checkpoints_path, g.mac FROM checkpoints c JOIN runs r ON r.pk=c.run_pk "
        "LEFT JOIN launch_grants g ON g.run_pk=c.run_pk WHERE c.id=?",
        (checkpoint_id,),
    ).first()
    if row is None:
        return None
    path, run_id = row[0], row[1]
    stored, granted, mac = tuple(row[2:5]), tuple(row[5:8]), row[8]  # (command, cwd, root)
    command, cwd, ck_root = granted
    if command is None:
        raise NotGranted(
            f"run {run_id!r} may not be launched from here: its run_start was not sent with "
            "the launch token"
        )
    why = tampered(signer, run_id, stored, granted, mac)
    if why is not None:
        log.error(
            "dashboard: refused to launch checkpoint %d of run %r: %s", checkpoint_id, run_id, why
        )
        raise NotGranted(f"run {run_id!r} may not be launched: {why}")
    if not ck_root:
        raise NotGranted(f"run {run_id!r} recorded no checkpoints path to resume from")
    if not is_inside(path, ck_root, cwd):
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
    try:
        private_dir(str(log_dir))  # 0700, this user's (checked again: it may have gone)
    except DatabaseFileError as e:
        raise LaunchError(f"no place for the launch's log: {e}") from None
    log_path = log_dir / f"resume-{time.time_ns()}.log"
    env = {**os.environ, **env_extra}
    # 0600, a new file (O_EXCL): the log shows the trainer's output, which is the owner's
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(log_path, flags, 0o600)
    except OSError as e:
        raise LaunchError(f"could not create the launch's log {log_path}: {e.strerror}") from None
    with os.fdopen(fd, "ab") as log:
        try:
            proc = subprocess.Popen(  # noqa: S603 - argv from the database, never from the request
                argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as e:
            raise LaunchError(f"could not start {argv[0]!r}: {e}") from None
    return Launched(pid=proc.pid, argv=argv, cwd=cwd, log=str(log_path)), proc
