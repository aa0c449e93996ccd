"""Exit when the launcher dies, instead of living on as an orphan.

torchrun starts each worker in its own session, so a SIGKILL of torchrun (or of its process
group) never reaches the workers: they trained on, then waited forever at exit for peers that
were gone. A daemon thread notices that the parent changed (the orphan is re-parented to init
or a subreaper) and ends the process within a second.
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLL_S = 0.5


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ


def watch_launcher(poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watcher when this process is a torchrun worker; returns the thread."""
    if not under_torchrun():
        return None
    parent = os.getppid()
    if parent == 1:  # already orphaned: nothing to watch
        return None

    def run() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                rank = os.environ.get("RANK", "?")
                print(
                    f"error: rank {rank}: the launcher (pid {parent}) died; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)  # no cleanup: it would wait on peers that are gone

    thread = threading.Thread(target=run, name="nanotron-launcher-watch", daemon=True)
    thread.start()
    return thread
