"""A worker's one-line error, shown once per node under torchrun, whichever rank stops first.

A user error (a bad config, a missing folder) is usually the same on every rank, and every rank
exits with it. torchrun stops the other workers (SIGTERM) as soon as one exits: a line that
rank 0 alone prints is lost whenever another rank exits first, and one that every rank prints
is shown N times. So the first rank of a node to fail claims the report:

1. It creates the node's marker file with O_EXCL (exactly one creator wins), prints its line to
   stderr, flushes, and only then writes "printed" into the marker and exits.
2. A rank that finds the marker made waits until it says "printed" (at most WAIT_S), then
   exits without printing.
No rank exits before the line is out, so torchrun kills nobody before it is printed.

Outside torchrun there is no launch to name a marker after, and rank 0 prints, as before.
The marker is named after the launch: the parent of the node's workers (torchrun's agent: its
pid and start time), torchrun's run id and restart count, and the host. Each launch and each
restart has its own; markers older than a day are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

WAIT_S = 30.0  # a claimant that has not printed by then is gone: print it ourselves
STALE_S = 24 * 3600.0


def report_first(line: str) -> None:
    """Print `line` to stderr unless a sibling worker of this launch already reports one;
    returns once the node's report is printed (so the caller may exit). Outside torchrun
    (one process, or ranks started some other way): rank 0 prints."""
    from nanotron_train.fault.launcher import under_torchrun

    if not under_torchrun():
        if int(os.environ.get("RANK", "0")) == 0:
            _print(line)
        return
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:  # the node's only worker
        _print(line)
        return
    try:
        marker = _marker_path()
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        _wait_printed(marker, line)
        return
    except OSError:  # no private temp folder: better twice than never
        _print(line)
        return
    _print(line)
    with contextlib.suppress(OSError):
        os.write(fd, b"printed")
    os.close(fd)


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _wait_printed(marker: Path, line: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if marker.read_bytes() == b"printed":
                return
        time.sleep(0.02)
    _print(line)


def _launch_key() -> str:
    parent = os.getppid()
    try:  # field 22 of /proc/PID/stat: the start time (a reused pid has another)
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = ""
    env = os.environ
    parts = (
        socket.gethostname(),
        str(parent),
        started,
        env.get("TORCHELASTIC_RUN_ID", ""),
        env.get("TORCHELASTIC_RESTART_COUNT", ""),
        env.get("MASTER_PORT", ""),
    )
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _marker_path() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = Path(tempfile.gettempdir()) / f"nanotron-train-errors-{uid}"
    folder.mkdir(mode=0o700, exist_ok=True)
    st = folder.lstat()  # another user may have made it first: then it is not ours to trust
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise OSError(f"{folder} is not a private folder of this user")
    now = time.time()
    for old in folder.iterdir():
        with contextlib.suppress(OSError):
            if now - old.stat().st_mtime > STALE_S:
                old.unlink()
    return folder / _launch_key()
