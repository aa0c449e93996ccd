"""Where the trainer meets checkpoints: start (clean up, resume), after a step, the end, a
rollback. Saves are synchronous or asynchronous (`checkpoints.async_save`); a failed save (disk
full, ...) is one line on every rank, then `checkpoints.on_save_error` stops or continues."""

from __future__ import annotations

import sys
from pathlib import Path

from nanotron_train.checkpoints.async_save import AsyncCheckpointer
from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.layout import LATEST_FILE
from nanotron_train.checkpoints.load import load_checkpoint, resolve_checkpoint
from nanotron_train.checkpoints.metadata import check_no_newer, read_metadata
from nanotron_train.checkpoints.save import _agree, check_shared, clean_leftovers, save_checkpoint
from nanotron_train.fault.coordination import shared_store
from nanotron_train.fault.errors import TrainingStopped


def resume_folder(resume: str | None, checkpoints_path: str | None) -> Path | None:
    """The folder to resume from; `auto` gives None (a fresh start) when there is none yet."""
    if not resume:
        return None
    if (
        resume == "auto"
        and checkpoints_path
        and not (Path(checkpoints_path) / LATEST_FILE).is_file()
    ):
        return None
    return resolve_checkpoint(resume, checkpoints_path)


MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3  # then the divergence is not a bad batch: stop


class Checkpointing:
    def __init__(self, trainer) -> None:
        self.trainer = trainer
        ck = trainer.cfg.checkpoints
        self.ck = ck
        self.last_saved: int | None = None  # the step of the last save started (or resumed)
        self.writer = None
        self._rollbacks: dict[int, int] = {}  # checkpoint step -> rollbacks to it
        if ck.async_save and ck.checkpoints_path:
            timeout = trainer.cfg.parallelism.collective_timeout_s
            store = shared_store(f"ckpt{trainer.trainer_id}")
            self.writer = AsyncCheckpointer(ck.checkpoints_path, trainer.pc, store, timeout)

    def on_start(self) -> int | None:
        """Remove unfinished saves (rank 0) and resume if configured; returns the resumed step."""
        t, ck = self.trainer, self.ck
        pc = t.pc
        if ck.checkpoints_path and pc.rank == 0:
            clean_leftovers(Path(ck.checkpoints_path))
        if ck.checkpoints_path and ck.checkpoints_path_is_shared_file_system:
            check_shared(Path(ck.checkpoints_path), pc)
        folder = resume_folder(ck.resume_checkpoint_path, ck.checkpoints_path)
        if folder is None:
            if ck.resume_checkpoint_path == "auto" and pc.rank == 0:
                print(f"--resume auto: no checkpoint in {ck.checkpoints_path}; starting fresh")
            return None
        if ck.checkpoints_path:  # never save over a newer checkpoint (checkpoints/metadata.py)
            _agree(pc, _newer_error(Path(ck.checkpoints_path), folder) if pc.rank == 0 else None)
        with t.grads.full_parameters():  # ZeRO-3: the loaded values go to the shards
            meta = load_checkpoint(folder, t.state, t.cfg, pc, t.zero_stage)
        _check_recorded_position(t.cfg, meta, folder)
        if pc.rank == 0:
            topo = meta["topology"]
            cp = f" cp={topo['cp']}" if topo.get("cp", 1) != 1 else ""
            cp += f" ep={topo['ep']}" if topo.get("ep", 1) != 1 else ""
            print(
                f"resumed from {folder} at step {meta['step']} (saved with dp={topo['dp']}{cp} "
                f"tp={topo['tp']} pp={topo['pp']} zero_stage={topo['zero_stage']})",
                flush=True,
            )
            if int(meta["step"]) >= (last := t.cfg.tokens.train_steps):  # nothing left to do
                print(
                    f"tokens.train_steps={last} is reached: nothing to train. To train on, "
                    f"resume with --override tokens.train_steps=N (N > {meta['step']})",
                    flush=True,
                )
        self.last_saved = int(meta["step"])
        return self.last_saved

    def save_initial(self) -> list[Path]:
        """checkpoints.save_initial_state: the state before the first step, as `<root>/0/`
        (not when resuming). Collective."""
        t = self.trainer
        if not (self.ck.save_initial_state and self.ck.checkpoints_path) or t.state.step != 0:
            return []
        if self.ck.resume_checkpoint_path and self.last_saved is not None:
            return []
        return self.after_step(force=True)

    def _due(self, force: bool) -> bool:
        step = self.trainer.state.step
        if not self.ck.checkpoints_path or step == self.last_saved:
            return False
        final = step >= self.trainer.cfg.tokens.train_steps and self.ck.save_final_state
        return force or final or step % self.ck.checkpoint_interval == 0

    def after_step(self, force: bool = False) -> list[Path]:
        """Save when due (every checkpoint_interval steps, the last step, or `force`); returns
        the checkpoints completed by this call. Collective."""
        if not self._due(force):
            return []
        t = self.trainer
        done = self.wait()  # never two saves at once
        self.last_saved = t.state.step
        if self.writer is not None:
            with t.grads.full_parameters():  # ZeRO-3: gathered while the snapshot copies them
                self.writer.start(t.state, t.cfg, t.zero_stage)
            return done
        try:
            with t.grads.full_parameters():
                folder = save_checkpoint(
                    self.ck.checkpoints_path, t.state, t.cfg, t.pc, t.zero_stage
                )
        except CheckpointError as exc:
            self._failed(t.state.step, exc)
            return done
        return [*done, folder]

    def wait(self) -> list[Path]:
        """Wait for a background save; returns it when it completed. Collective."""
        if self.writer is None or self.writer.pending is None:
            return []
        step = self.writer.pending
        try:
            return [self.writer.wait()]
        except CheckpointError as exc:
            self._failed(step, exc)
            return []

    def _failed(self, step: int, exc: CheckpointError) -> None:
        root = Path(self.ck.checkpoints_path)
        latest = root / LATEST_FILE
        previous = latest.read_text().strip() if latest.is_file() else None
        kept = f"{root / previous} stays latest" if previous else "there is no earlier checkpoint"
        line = f"checkpoint of step {step} not saved: {exc}; {kept}"
        if self.ck.on_save_error == "stop":
            raise TrainingStopped(f"{line} (checkpoints.on_save_error: stop)") from None
        if self.trainer.pc.rank == 0:
            print(
                f"warning: {line}; training continues (checkpoints.on_save_error: continue)",
                file=sys.stderr,
                flush=True,
            )

    def rollback(self) -> int:
        """Reload the last complete checkpoint, keeping the data position (the data of the
        steps since is skipped); returns the step rolled back to. Collective."""
        t = self.trainer
        self.wait()
        folder = resume_folder("latest", self.ck.checkpoints_path) if self._has_latest() else None
        if folder is None:
            raise TrainingStopped(
                f"non-finite values at step {t.state.step} and no checkpoint to roll back to in "
                f"{self.ck.checkpoints_path} (fault_tolerance.nonfinite_policy: rollback)"
            )
        s = t.state
        bad_step = s.step
        back_to = int(folder.name)
        self._rollbacks[back_to] = self._rollbacks.get(back_to, 0) + 1
        if self._rollbacks[back_to] > MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
            raise TrainingStopped(
                f"non-finite values at step {bad_step} again after {MAX_ROLLBACKS_TO_ONE_CHECKPOINT}"
                f" rollbacks to the checkpoint of step {back_to}, each skipping more data "
                "(fault_tolerance.nonfinite_policy: rollback)"
            )
        data_state, served = s.data.state_dict(), s.step + s.data_step_offset
        with t.grads.full_parameters():
            load_checkpoint(folder, s, t.cfg, t.pc, t.zero_stage)
        s.data.load_state_dict(data_state)
        s.data_step_offset = served - s.step  # the next step takes the data after the bad one
        self.last_saved = s.step
        return s.step

    def _has_latest(self) -> bool:
        return (Path(self.ck.checkpoints_path) / LATEST_FILE).is_file()


def _newer_error(root: Path, folder: Path) -> str | None:
    try:
        step = read_metadata(folder)["step"]
    except CheckpointError:
        return None  # load_checkpoint says what is wrong with it, on every rank
    return check_no_newer(root, folder, step)


def _check_recorded_position(cfg, meta: dict, folder: Path) -> None:
    """general.step / consumed_train_samples, when a config carries them (a checkpoint's
    config.yaml does), must describe the checkpoint it resumes from."""
    for key, have in (
        ("step", meta["step"]),
        ("consumed_train_samples", meta.get("consumed_samples")),
    ):
        want = getattr(cfg.general, key)
        if want is not None and want != have:
            raise CheckpointError(
                f"general.{key}: the config says {want} but {folder} is at {have}; "
                "set it to null or resume from the checkpoint it was saved with"
            )
