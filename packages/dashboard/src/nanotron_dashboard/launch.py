"""Starting a resume from a listed checkpoint: the stored command, the stored cwd, no shell."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .checkpoints import resume_argv
from .errors import DashboardError


class LaunchError(DashboardError):
    pass


@dataclass
class Launched:
    pid: int
    argv: list[str]
    cwd: str
    log: str


def launch_resume(
    command: list[str],
    cwd: str | None,
    checkpoint_path: str,
    log_dir: Path,
    env_extra: dict[str, str],
) -> Launched:
    if not command:
        raise LaunchError("this run recorded no command line, so it cannot be resumed from here")
    if not cwd or not Path(cwd).is_dir():
        raise LaunchError(f"the run's working directory {cwd!r} does not exist on this machine")
    argv = resume_argv(command, checkpoint_path)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"resume-{int(time.time() * 1000)}.log"
    env = {**os.environ, **env_extra}
    with open(log_path, "ab") as log:
        try:
            proc = subprocess.Popen(  # noqa: S603 - argv from the database, never from the request
                argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as e:
            raise LaunchError(f"could not start {argv[0]!r}: {e}") from None
    return Launched(pid=proc.pid, argv=argv, cwd=cwd, log=str(log_path))
