"""Checks of the fault-tolerance keys: the `fault_tolerance` section (schema.py) and the keys
that sit where a user looks for them, `parallelism.collective_timeout_s`,
`checkpoints.async_save` and `checkpoints.on_save_error`."""

from __future__ import annotations

from nanotron_train.config.rules import Check, at_least, positive, value


def _spike_window(key: str) -> Check:
    """A robust z-score's window: 0 turns it off, and fewer than 8 losses say nothing."""
    return Check(
        key,
        lambda c: value(c, key) == 0 or value(c, key) >= 8,
        lambda c: f"must be 0 (off) or >= 8, got {value(c, key)}",
    )


FAULT_CHECKS: tuple[Check, ...] = (
    positive("parallelism.collective_timeout_s"),
    _spike_window("fault_tolerance.loss_spike_window"),
    positive("fault_tolerance.loss_spike_zscore"),
    _spike_window("fault_tolerance.grad_norm_spike_window"),
    positive("fault_tolerance.grad_norm_spike_zscore"),
    Check(
        "fault_tolerance.stack_dump_dir",
        lambda c: bool(c.fault_tolerance.stack_dump_dir),
        "must be a path",
    ),
    Check(
        "fault_tolerance.nonfinite_policy",
        lambda c: (
            c.fault_tolerance.nonfinite_policy != "rollback" or bool(c.checkpoints.checkpoints_path)
        ),
        "rollback needs checkpoints.checkpoints_path (it reloads the last checkpoint)",
    ),
    positive("fault_tolerance.spike_rollback_min_steps"),
    at_least("fault_tolerance.spike_skip_batches", 0),
    positive("fault_tolerance.max_spike_rollbacks"),
    Check(
        "fault_tolerance.loss_spike_policy",
        lambda c: (
            c.fault_tolerance.loss_spike_policy != "rollback"
            or (bool(c.checkpoints.checkpoints_path) and c.fault_tolerance.loss_spike_window > 0)
        ),
        "rollback needs checkpoints.checkpoints_path and fault_tolerance.loss_spike_window > 0",
    ),
    Check(
        "checkpoints.async_save",
        lambda c: not c.checkpoints.async_save or bool(c.checkpoints.checkpoints_path),
        "needs checkpoints.checkpoints_path",
    ),
)
