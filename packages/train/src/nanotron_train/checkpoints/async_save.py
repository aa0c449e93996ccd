"""Asynchronous checkpoints (`checkpoints.async_save: true`): the step waits only for the copy.

`start()` takes a host copy of this rank's tensors (the only part the training step waits
for) and hands it to a background thread, which writes the files exactly as a synchronous save
does, into `<root>/.tmp-<step>/`. The ranks meet through the shared store, never through
collectives (those would interleave with the training step's): each posts its file records or
its error; rank 0's thread waits for all of them, then seals (metadata, rename, latest.txt) or
removes the folder, and posts the outcome. `wait()` (at the start of the next save, at the end,
before a preemption exit or a rollback) joins the thread and reads that outcome, so every rank
learns it at the same step, and two saves never overlap. A crash during the background write
leaves `.tmp-<step>` (removed at the next start) and latest.txt naming the previous checkpoint.
"""

from __future__ import annotations

import json
import shutil
import threading
from datetime import timedelta
from pathlib import Path

from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.files import FileRecord
from nanotron_train.checkpoints.layout import TMP_PREFIX
from nanotron_train.checkpoints.save import Snapshot, seal_or_error, snapshot, write_snapshot


class AsyncCheckpointer:
    def __init__(self, root: str | Path, pc, store, timeout_s: float) -> None:
        self.root, self.pc, self.store = Path(root), pc, store
        self.timeout = timedelta(seconds=timeout_s)
        self._thread: threading.Thread | None = None
        self._step: int | None = None

    @property
    def pending(self) -> int | None:
        """The step being written in the background, if any."""
        return self._step

    def start(self, state, cfg, zero_stage: int) -> None:
        """Copy this rank's state to host memory and write it in the background."""
        if self._thread is not None:
            raise RuntimeError("wait() for the previous checkpoint before starting another")
        snap = snapshot(state, cfg, self.pc, zero_stage, copy=True)
        self._step = snap.step
        self._thread = threading.Thread(
            target=self._write, args=(snap,), name=f"nanotron-ckpt-{snap.step}", daemon=True
        )
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the pending save is sealed (or failed) on every rank; returns its folder,
        None when nothing was pending; raises the same CheckpointError on every rank."""
        if self._thread is None:
            return None
        self._thread.join()
        step, self._thread, self._step = self._step, None, None
        key = f"ckpt/{step}/outcome"
        self.store.wait([key], self.timeout)
        outcome = json.loads(self.store.get(key))
        if outcome["error"]:
            raise CheckpointError(outcome["error"])
        return self.root / str(step)

    # -- the background thread -----------------------------------------------------------
    def _write(self, snap: Snapshot) -> None:
        tmp = self.root / f"{TMP_PREFIX}{snap.step}"
        result: dict = {"records": [], "error": None}
        try:
            result["records"] = [r.to_dict() for r in write_snapshot(tmp, snap)]
        except OSError as exc:
            result["error"] = f"{tmp}: writing the checkpoint failed ({exc})"
        self.store.set(f"ckpt/{snap.step}/rank{self.pc.rank}", json.dumps(result))
        if self.pc.rank == 0:
            self.store.set(f"ckpt/{snap.step}/outcome", json.dumps({"error": self._seal(snap)}))

    def _seal(self, snap: Snapshot) -> str | None:
        tmp = self.root / f"{TMP_PREFIX}{snap.step}"
        keys = [f"ckpt/{snap.step}/rank{r}" for r in range(self.pc.world_size)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception as exc:  # noqa: BLE001 - a rank died or hung while writing
            shutil.rmtree(tmp, ignore_errors=True)
            return f"{tmp}: not every rank finished writing ({exc})"
        results = [json.loads(self.store.get(k)) for k in keys]
        error = next((r["error"] for r in results if r["error"]), None)
        if error:
            shutil.rmtree(tmp, ignore_errors=True)
            return error
        files = [FileRecord(**rec) for r in results for rec in r["records"]]
        return seal_or_error(self.root, tmp, snap, files)
