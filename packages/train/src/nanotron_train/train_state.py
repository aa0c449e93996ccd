"""What a training step carries: the state a checkpoint saves, and one step's results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanotron_train.lr_schedule import LRSchedule
from nanotron_train.optim import AdamWOnPieces


@dataclass
class TrainState:
    """What a checkpoint saves and restores: together they continue a run exactly."""

    model: nn.Module
    optimizer: AdamWOnPieces  # includes the ZeRO-1 shard of this rank
    lr_schedule: LRSchedule
    data: Any  # SyntheticData or TrainData: micro_batches(step), state_dict(), load_state_dict()
    step: int = 0  # optimizer steps done
    consumed_samples: int = 0
    consumed_tokens: int = 0
    data_step_offset: int = 0  # steps whose data a rollback skipped (data step = step + this)
    # the loss-spike rollbacks of the run so far (fault/spike_recovery.py): count and skips
    spike_rollbacks: list[dict[str, int]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepOutput:
    """One step's results, still on the device (reading them is a host sync)."""

    step: int
    loss: torch.Tensor | None  # the mean loss on the last pipeline stage, None elsewhere
    grad_norm: torch.Tensor
    lr: float
    sequence_length: int
    z_loss: torch.Tensor | None = None  # this rank's mean z-loss (last stage), when enabled
    action: str = "ok"  # the non-finite policy's decision (fault/nonfinite.py)
    # The global loss and norm, when the step already read them (skip / rollback policies).
    host_values: tuple[float, float] | None = None
