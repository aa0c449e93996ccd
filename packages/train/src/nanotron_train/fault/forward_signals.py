"""Preemption through the launcher: SIGTERM or SIGUSR1 to `nanotron_train.launch` is passed on.

A batch scheduler signals the job's process group (SLURM's `--signal=TERM@120`, a `kill` of the
job). torchrun starts every worker in a session of its own, so the signal reaches the agent
only, and torchrun's agent answers it by sending SIGTERM to the workers, waiting 30 s, killing
them and exiting with 1 after a `SignalException` traceback: a job whose ranks saved and
stopped cleanly is marked FAILED, and a save that needs more than 30 s is killed mid-write.

`nanotron_train.launch` takes those two signals away from torchrun's agent
(torchrun's `--signals-to-handle`) and forwards each to the workers instead. They finish the
step, save and exit 0 (fault/preemption.py); the agent sees every worker succeed and the launch
exits 0, however long the save takes. Before any worker runs there is nothing to save: the
signal then stops the launch as torchrun would (SignalException, exit 128 + the signal number).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)
# torchrun's default list less what we forward: Ctrl-C (SIGINT) still stops everything at once.
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def worker_pids(pid: int) -> list[int]:
    """The children of `pid` that are torchrun workers (LOCAL_RANK in their environment; not
    the agent's other helpers). Linux /proc; empty elsewhere."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes()
            except OSError:
                continue
            if b"\0LOCAL_RANK=" in b"\0" + environ:
                found.append(child)
    return found


class SignalForwarder:
    """Installed in the launcher's main thread before torchrun's agent starts the workers."""

    def __init__(self, torchrun_args) -> None:
        """`torchrun_args`: torchrun's parsed arguments (its `--signals-to-handle` is set)."""
        self.received: str | None = None
        torchrun_args.signals_to_handle = TORCHRUN_SIGNALS
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        workers = worker_pids(os.getpid())
        if not workers:  # nothing started yet: nothing to save, stop the launch
            from torch.distributed.elastic.multiprocessing.api import SignalException

            raise SignalException(f"{name} before any worker started", sigval=signum)
        if self.received is None:
            print(
                f"launcher: {name} received: passed to the {len(workers)} workers; they finish "
                "the step, save a checkpoint and exit",
                file=sys.stderr,
                flush=True,
            )
        self.received = name
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
