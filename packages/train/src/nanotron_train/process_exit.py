"""Ending a worker process once its outcome is known: the exit status is that outcome, every time.

When `main()` returns, CPython finalizes: it tears down modules and, with them, C++ state (torch,
gloo, store clients), while daemon threads may still run. A daemon thread that is inside a C++
call with the GIL released (a torch op, a store request: torch's bindings release the GIL) and
wakes after finalization began is ended with pthread_exit from inside a C++ destructor, and the
whole process aborts: "terminate called without an active exception", SIGABRT, after the last
step. torchrun then reports the finished run as failed (and `--max-restarts` restarts it).

The trainer joins its own threads before it returns, but a library's daemon threads are not
ours to join. So a finished process does its own orderly part of the exit (atexit handlers,
non-daemon threads joined, logging and stdio flushed) and then leaves with `os._exit(status)`:
nothing runs after the outcome is decided, so nothing can change it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_process(status: int) -> NoReturn:
    """What `sys.exit(status)` does before finalizing, then `os._exit(status)`."""
    # Python's own first exit step: threading's exit hooks (executors stop their workers), then
    # every non-daemon thread joined. Private, but the very call the interpreter makes.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()  # what `sys.exit` would run: sinks' flushes, temp files
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
