"""Run a function in N real processes (gloo on the CPU), as torchrun would, for tests.

``run_distributed(fn, world_size, *args, timeout=120, **kwargs)`` spawns ``world_size``
children with the torchrun environment set (a free port on 127.0.0.1, one thread each, GPUs
hidden so the backend is gloo), runs ``fn(*args, **kwargs)`` in each and returns the list of
their return values in rank order. The first failing rank, or the timeout (which includes
process start-up), kills every child and raises :class:`DistributedTestError` with that rank's
traceback. No child outlives the call.

Children are forked from a fork server (multiprocessing's "forkserver") that imported torch
and the modules named by `preload()` once: a spawned child spends seconds of CPU importing
them again, which on a small machine was much of a distributed test's time. A child still
starts clean (the server never initialised a process group or ran a test) and gets the
caller's environment variables and working directory of the moment of the call, as a spawned
child would.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import inspect
import os
import pickle
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

# A child that exited without a message gets this long for one still in the pipe to arrive.
_DEAD_GRACE_S = 2.0
_POLL_S = 0.1
# How long ranks that all succeeded get to exit by themselves before being terminated.
_EXIT_GRACE_S = 10.0


class DistributedTestError(AssertionError):
    """A rank of a run_distributed call failed, or the call timed out."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        child_traceback: str = "",
        ranks: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank  # the failing rank (the first unfinished one on timeout)
        self.child_traceback = child_traceback
        self.ranks = ranks if ranks is not None else ([] if rank is None else [rank])


@dataclass(frozen=True)
class _FnRef:
    """Where a child finds ``fn``: by module name, falling back to the file it came from.

    pytest's importlib mode may give test modules names a child cannot import, so the file
    path lets the child load the same module under the same name.
    """

    module: str
    qualname: str
    file: str | None

    @classmethod
    def of(cls, fn: Any) -> _FnRef:
        qualname = getattr(fn, "__qualname__", "")
        if not callable(fn) or "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(
                f"run_distributed needs a module-level function, got {fn!r}: spawned "
                "processes must be able to import it"
            )
        try:
            file = inspect.getsourcefile(fn)
        except TypeError:
            file = None
        return cls(fn.__module__, qualname, None if file is None else os.path.abspath(file))

    def resolve(self) -> Any:
        module = sys.modules.get(self.module)
        if module is None or not self._same_file(module):
            module = self._import()
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def _same_file(self, module: Any) -> bool:
        found = getattr(module, "__file__", None)
        return self.file is None or (found is not None and os.path.abspath(found) == self.file)

    def _import(self) -> Any:
        try:
            module = importlib.import_module(self.module)
            if self._same_file(module):
                return module
        except ImportError:
            if self.file is None:
                raise
        spec = importlib.util.spec_from_file_location(self.module, self.file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {self.module} from {self.file}")
        module = importlib.util.module_from_spec(spec)
        # Registered before running so that pickled arguments can refer to the module.
        sys.modules[self.module] = module
        spec.loader.exec_module(module)
        return module


# What the fork server imports before forking any child (see the module docstring).
_PRELOAD = ["torch", "torch.distributed", "nanotron_parallel.testing"]


def preload(*modules: str) -> None:
    """Also import `modules` in the fork server (call before the first `run_distributed`; a
    module that cannot be imported there is left to each child)."""
    for name in modules:
        if name not in _PRELOAD:
            _PRELOAD.append(name)


def _context() -> Any:
    # NANOTRON_TEST_START_METHOD=spawn: the old way (every child imports everything itself).
    method = os.environ.get("NANOTRON_TEST_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


@contextlib.contextmanager
def shared_default_group():
    """One default gloo group for a whole launch that runs several layouts in turn.

    Each `ParallelContext` made inside reuses it and creates (and destroys) only its own
    subgroups, so a launch pays process start-up and rendezvous once. Outside torchrun it is a
    world of one. Leaving the block normally waits for every rank.
    """
    import torch.distributed as dist

    owner = not dist.is_initialized()
    if owner and "RANK" in os.environ:
        dist.init_process_group("gloo", init_method="env://")
    elif owner:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    finished = False
    try:
        yield
        finished = True
    finally:
        if owner:
            if finished and dist.get_world_size() > 1:
                # Rank 0 hosts the store: it leaves only once every rank is done with it (a
                # rank's last store lookup can come after the last collective). Only on success,
                # so that a failed rank reports at once instead of waiting for the others.
                dist.barrier()
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(
    ref: _FnRef,
    payload: bytes,
    rank: int,
    world_size: int,
    port: int,
    results: Any,
    here: tuple[dict[str, str], str],
) -> None:
    env, cwd = here
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES="",
    )
    torch.set_num_threads(1)
    if hasattr(signal, "SIGUSR1"):
        # On timeout the parent asks for every thread's stack before killing: shows the hang.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        fn = ref.resolve()
        args, kwargs = pickle.loads(payload)
        value = fn(*args, **kwargs)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure, even SystemExit, goes to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            # Cleanup of a failed run must not mask its error.
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _stop(procs: list[Any]) -> None:
    """Terminate, then kill, every child still alive; reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_distributed(fn: Any, world_size: int, *args: Any, timeout: float = 120, **kwargs: Any):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return their results."""
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size={world_size} must be >= 1")
    ref = _FnRef.of(fn)
    payload = pickle.dumps((args, kwargs))
    ctx = _context()
    here = (dict(os.environ), os.getcwd())  # what a spawned child would have inherited
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(ref, payload, rank, world_size, port, results, here),
            name=f"run_distributed-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        values = _collect(procs, results, world_size, timeout, fn)
        # Every rank reported: let them finish their own cleanup before anything is killed.
        finish_by = time.monotonic() + _EXIT_GRACE_S
        for p in procs:
            p.join(timeout=max(0.0, finish_by - time.monotonic()))
        return values
    finally:
        _stop(procs)
        results.close()
        results.cancel_join_thread()


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float, fn: Any) -> list:
    name = getattr(fn, "__qualname__", repr(fn))
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    while len(values) < world_size:
        now = time.monotonic()
        if now >= deadline:
            missing = sorted(set(range(world_size)) - set(values))
            _dump_stacks(procs)
            raise DistributedTestError(
                f"run_distributed({name}, world_size={world_size}) timed out after "
                f"{timeout:g}s; ranks {missing} did not finish",
                rank=missing[0],
                ranks=missing,
            )
        try:
            rank, ok, data = results.get(timeout=min(_POLL_S, deadline - now))
        except queue_mod.Empty:
            _check_dead(procs, values, dead_since, name)
            continue
        if not ok:
            raise DistributedTestError(
                f"rank {rank} of {world_size} failed in {name}:\n{data}",
                rank=rank,
                child_traceback=data,
            )
        values[rank] = pickle.loads(data)
    return [values[r] for r in range(world_size)]


def _dump_stacks(procs: list[Any]) -> None:
    """Ask hanging children to print their Python stacks to stderr (captured by pytest)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for p in procs:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)


def _check_dead(procs: list[Any], values: dict, dead_since: dict[int, float], name: str) -> None:
    """Fail for a child that died (e.g. killed by a signal) without sending anything."""
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if rank in values or p.exitcode is None:
            continue
        first = dead_since.setdefault(rank, now)
        if now - first > _DEAD_GRACE_S:
            raise DistributedTestError(
                f"rank {rank} of {len(procs)} exited with code {p.exitcode} in {name} "
                "without reporting a result",
                rank=rank,
            )
