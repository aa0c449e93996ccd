"""The two places the trainer calls checkpoints: at start (clean up, resume) and after a step."""

from __future__ import annotations

from pathlib import Path

from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.load import load_checkpoint, resolve_checkpoint
from nanotron_train.checkpoints.save import clean_leftovers, save_checkpoint


def on_start(trainer) -> int | None:
    """Remove unfinished saves (rank 0) and resume if configured; returns the resumed step."""
    cfg, pc = trainer.cfg, trainer.pc
    ck = cfg.checkpoints
    if ck.checkpoints_path and pc.rank == 0:
        clean_leftovers(Path(ck.checkpoints_path))
    if not ck.resume_checkpoint_path:
        return None
    folder = resolve_checkpoint(ck.resume_checkpoint_path, ck.checkpoints_path)
    meta = load_checkpoint(folder, trainer.state, cfg, pc, trainer.zero_stage)
    _check_recorded_position(cfg, meta, folder)
    if pc.rank == 0:
        t = meta["topology"]
        print(
            f"resumed from {folder} at step {meta['step']} "
            f"(saved with dp={t['dp']} tp={t['tp']} pp={t['pp']} zero_stage={t['zero_stage']})",
            flush=True,
        )
    return int(meta["step"])


def after_step(trainer, last_saved: int | None) -> Path | None:
    """Save when the step is a multiple of checkpoint_interval, or the last one
    (save_final_state); returns the new checkpoint folder or None. Collective."""
    cfg, state = trainer.cfg, trainer.state
    ck = cfg.checkpoints
    if not ck.checkpoints_path or state.step == last_saved:
        return None
    final = state.step >= cfg.tokens.train_steps and ck.save_final_state
    if state.step % ck.checkpoint_interval != 0 and not final:
        return None
    return save_checkpoint(ck.checkpoints_path, state, cfg, trainer.pc, trainer.zero_stage)


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


def save_initial(trainer) -> Path | None:
    """checkpoints.save_initial_state: the state before the first step, as `<root>/0/`
    (not when resuming). Collective."""
    ck, state = trainer.cfg.checkpoints, trainer.state
    if not (ck.save_initial_state and ck.checkpoints_path) or state.step != 0:
        return None
    if ck.resume_checkpoint_path:
        return None
    return save_checkpoint(ck.checkpoints_path, state, trainer.cfg, trainer.pc, trainer.zero_stage)
