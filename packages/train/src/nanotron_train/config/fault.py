"""Config of the fault-tolerance features (issue 16) and their checks.

The new keys sit where a user looks for them: `parallelism.collective_timeout_s`,
`checkpoints.async_save` and `checkpoints.on_save_error` in their sections (config.py), the
rest in the `fault_tolerance` section below. Kept out of config.py so that file stays about
Nanotron's core sections; `validate` there calls `validate_fault` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from nanotron_train.config.loader import ConfigError

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config


@dataclass
class FaultToleranceArgs:
    """What happens on a non-finite loss or gradient norm, loss-spike detection, stack dumps.

    nonfinite_policy: `stop` (exit naming the step and the first parameter with a non-finite
    gradient), `skip` (no optimizer step; counted and logged) or `rollback` (reload the last
    checkpoint and skip the data of the steps since). loss_spike_window: past losses the robust
    z-score uses (0 = off); loss_spike_zscore: the threshold; grad_norm_spike_window and
    grad_norm_spike_zscore: the same for the gradient norm. stack_dump_dir: where a hung
    rank writes all its threads' stacks (one file per rank).
    """

    nonfinite_policy: Literal["stop", "skip", "rollback"] = "stop"
    loss_spike_window: int = 100
    loss_spike_zscore: float = 6.0
    grad_norm_spike_window: int = 100
    grad_norm_spike_zscore: float = 6.0
    stack_dump_dir: str = "stack_dumps"


def _check(cond: bool, key: str, message: str, source: str) -> None:
    if not cond:
        raise ConfigError(key, message, source)


def validate_fault(cfg: Config, source: str) -> None:
    ft = cfg.fault_tolerance
    timeout = cfg.parallelism.collective_timeout_s
    _check(timeout > 0, "parallelism.collective_timeout_s", f"must be > 0, got {timeout}", source)
    _check(
        ft.loss_spike_window == 0 or ft.loss_spike_window >= 8,
        "fault_tolerance.loss_spike_window",
        f"must be 0 (off) or >= 8, got {ft.loss_spike_window}",
        source,
    )
    _check(
        ft.loss_spike_zscore > 0,
        "fault_tolerance.loss_spike_zscore",
        f"must be > 0, got {ft.loss_spike_zscore}",
        source,
    )
    _check(
        ft.grad_norm_spike_window == 0 or ft.grad_norm_spike_window >= 8,
        "fault_tolerance.grad_norm_spike_window",
        f"must be 0 (off) or >= 8, got {ft.grad_norm_spike_window}",
        source,
    )
    _check(
        ft.grad_norm_spike_zscore > 0,
        "fault_tolerance.grad_norm_spike_zscore",
        f"must be > 0, got {ft.grad_norm_spike_zscore}",
        source,
    )
    _check(bool(ft.stack_dump_dir), "fault_tolerance.stack_dump_dir", "must be a path", source)
    ck = cfg.checkpoints
    if ft.nonfinite_policy == "rollback":
        _check(
            bool(ck.checkpoints_path),
            "fault_tolerance.nonfinite_policy",
            "rollback needs checkpoints.checkpoints_path (it reloads the last checkpoint)",
            source,
        )
    if ck.async_save:
        _check(
            bool(ck.checkpoints_path),
            "checkpoints.async_save",
            "needs checkpoints.checkpoints_path",
            source,
        )
