"""Hang watchdog: a collective or p2p blocked past the timeout fails every rank, saying who hung.

Zero cost in the training step: a daemon thread samples the main thread's Python stack once a
poll. The frame that calls into a blocking collective stays the same frame (same address, code
and instruction) while it waits, within the same step. Blocked that way in communication code
(torch.distributed or nanotron_parallel) for longer than `timeout_s`, the rank:
  1. writes every thread's stack to `<stack_dump_dir>/stacks-rank<R>.txt` (faulthandler);
  2. reads the others' heartbeats from the shared store to find the rank that did not arrive:
     one whose heartbeat stopped (SIGSTOPped, dead, stuck in the interpreter), else one not
     waiting in a collective, else one behind in steps;
  3. prints one line (step, phase, who) and posts it to the store, where every other rank's
     watchdog finds it within a poll and exits with it too;
  4. exits with status 1 at once (a clean shutdown would wait on the hung peer).
On GPUs the host waits at the next synchronisation, not in the NCCL kernel; the phase is then
where the host waited, and NCCL's own timeout (set a little above ours) backs this up.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from nanotron_train.fault.coordination import try_get

HANG_KEY = "hang"
HANG_DETAILS_KEY = "hang_details"  # JSON: step, phase, the rank(s) that did not arrive

# (path fragment, phase), innermost frame first: the first match names the phase.
_PHASES = (
    ("nanotron_parallel/pipeline/p2p", "pp p2p"),
    ("nanotron_parallel/tensor_parallel/", "tp"),
    ("nanotron_parallel/data_parallel/zero", "optimizer"),
    ("nanotron_parallel/data_parallel", "dp"),
    ("nanotron_parallel/tied", "tied embeddings"),
    ("nanotron_parallel/clip", "optimizer"),
    ("nanotron_train/optim", "optimizer"),
    ("nanotron_parallel/pipeline/schedules", "pp loss broadcast"),
    ("nanotron_train/checkpoints/", "checkpoint"),
    ("nanotron_train/data", "data"),
    ("nanotron_train/eval/evaluation", "evaluation"),
    ("nanotron_train/trainer", "loss dp all-reduce"),
)
_COMM = ("/torch/distributed/", "nanotron_parallel/")


def _stack(frame: FrameType | None) -> list[FrameType]:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def _path(frame: FrameType) -> str:
    return frame.f_code.co_filename.replace("\\", "/")


def phase_of(frames: list[FrameType]) -> str:
    for frame in frames:
        path = _path(frame)
        for fragment, phase in _PHASES:
            if fragment in path:
                return phase
    return "other"


def in_communication(frames: list[FrameType]) -> bool:
    return any(any(c in _path(f) for c in _COMM) for f in frames)


class HangWatchdog:
    """One per rank; `start()` after the process groups exist, `stop()` at the end."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        step: Callable[[], int],
        stack_dump_dir: str,
        store=None,
        poll_s: float | None = None,
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.step, self.store = step, store
        self.dump_path = Path(stack_dump_dir) / f"stacks-rank{rank}.txt"
        self.poll_s = poll_s or max(0.05, min(1.0, timeout_s / 10))
        self._main = threading.main_thread().ident
        # Called (on the watchdog's thread) with the line and its details just before the
        # process exits: rank 0 reports a `stall` event to the dashboard (telemetry/).
        self.on_hang: Callable[[str, dict], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanotron-watchdog", daemon=True)
        self._beat = 0

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        seen: tuple | None = None
        since = time.monotonic()
        while not self._stop.wait(self.poll_s):
            frame = sys._current_frames().get(self._main)
            frames = _stack(frame)
            now = time.monotonic()
            # Not the frame itself: holding it would keep a finished call's tensors alive.
            where = (id(frame), frame.f_lasti, frame.f_code) if frame is not None else None
            if (where, self.step()) != seen:
                seen, since = (where, self.step()), now
            blocked = frames and in_communication(frames)
            waited = now - since if blocked else 0.0
            self._heartbeat(phase_of(frames) if frames else "idle", waited)
            other = self._posted_hang()
            if other is not None:
                self._report(other, self._posted_details())
                self._exit(f"{other} (seen by rank {self.rank})")
            if blocked and waited > self.timeout_s:
                self._fire(frames, waited)
            del frame, frames

    def _heartbeat(self, phase: str, waited: float) -> None:
        if self.store is None:
            return
        self._beat += 1
        with contextlib.suppress(Exception):  # the store is gone: the launcher will end us
            self.store.set(f"hb/{self.rank}", f"{self._beat}|{self.step()}|{phase}|{waited:.1f}")

    def _posted_hang(self) -> str | None:
        if self.store is None:
            return None
        try:
            value = try_get(self.store, HANG_KEY)
        except Exception:  # noqa: BLE001
            return None
        return value.decode() if value else None

    def _posted_details(self) -> dict:
        with contextlib.suppress(Exception):
            raw = try_get(self.store, HANG_DETAILS_KEY) if self.store is not None else None
            if raw:
                return json.loads(raw.decode())
        return {}

    def _report(self, line: str, details: dict) -> None:
        if self.on_hang is not None:
            with contextlib.suppress(Exception):  # the exit must happen whatever this does
                self.on_hang(line, details)

    def _heartbeats(self) -> dict[int, tuple[int, int, str, float]]:
        beats = {}
        for r in range(self.world_size):
            raw = try_get(self.store, f"hb/{r}")
            if raw:
                beat, step, phase, waited = raw.decode().split("|")
                beats[r] = (int(beat), int(step), phase, float(waited))
        return beats

    def _who(self) -> tuple[str, list[int]]:
        """The rank(s) that did not arrive, with why; read in a helper thread (the store's host
        may be the hung process when not under torchrun)."""
        if self.store is None or self.world_size == 1:
            return "unknown rank", []
        result: list[tuple[str, list[int]]] = []

        def read() -> None:
            first = self._heartbeats()
            time.sleep(3 * self.poll_s + 0.5)
            second = self._heartbeats()
            me = second.get(self.rank, (0, self.step(), "", 0.0))
            stale = [
                r
                for r in range(self.world_size)
                if r != self.rank  # our own beats pause while we read
                and (r not in second or (r in first and first[r][0] == second[r][0]))
            ]
            if stale:
                text = " ".join(f"rank {r}" for r in stale)
                text += " (no heartbeat: stopped, dead or stuck outside a collective)"
                result.append((text, stale))
                return
            idle = [r for r, b in second.items() if b[3] == 0.0 and r != self.rank]
            if idle:
                parts = [f"rank {r} (at step {second[r][1]}, in {second[r][2]})" for r in idle]
                result.append((", ".join(parts) + " (not waiting in a collective)", idle))
                return
            behind = [r for r, b in second.items() if b[1] < me[1]]
            if behind:
                text = ", ".join(f"rank {r} (at step {second[r][1]})" for r in behind)
                result.append((text, behind))
                return
            text = "no single rank (every rank waits: a mismatched collective order)"
            result.append((text, []))

        helper = threading.Thread(target=read, daemon=True)
        helper.start()
        helper.join(timeout=10 * self.poll_s + 5)
        return result[0] if result else ("unknown rank (the shared store does not answer)", [])

    def _dump_stacks(self) -> str:
        try:
            self.dump_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.dump_path, "w") as f:
                f.write(f"rank {self.rank}, pid {os.getpid()}, step {self.step()}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            return str(self.dump_path)
        except OSError as exc:
            return f"(not written: {exc.strerror})"

    def _fire(self, frames: list[FrameType], waited: float) -> None:
        phase = phase_of(frames)
        dump = self._dump_stacks()
        who, ranks = self._who()
        line = (
            f"collective timeout at step {self.step()}: rank {self.rank} waited {waited:.0f}s "
            f"(parallelism.collective_timeout_s={self.timeout_s:g}) in {phase} for {who}"
        )
        details = {
            "step": self.step(),
            "phase": phase,
            "rank": ranks[0] if ranks else None,  # the rank that did not arrive
            "ranks": ranks,
            "seen_by": self.rank,
            "waited_s": round(waited, 1),
        }
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(HANG_DETAILS_KEY, json.dumps(details))  # before the line
                self.store.set(HANG_KEY, line)
        self._report(line, details)
        self._exit(line, dump)

    def _exit(self, line: str, dump: str | None = None) -> None:
        dump = dump or self._dump_stacks()
        print(f"error: {line}; all threads' stacks in {dump}", file=sys.stderr, flush=True)
        os._exit(1)
