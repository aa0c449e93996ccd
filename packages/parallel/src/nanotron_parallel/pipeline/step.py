"""What every pipeline schedule shares: the micro-batch type, the step's result, its counters.

The loss of a step stays on the device (`PipelineStepResult.loss_tensor`): reading it on the
host is a sync, which the trainer does only on the steps it logs. Live micro-batches are
counted always (a Python integer); the bytes autograd saves for them are measured only when
asked (`track_activations=True`, for tests and the profiler), since that installs
saved-tensor hooks on every forward.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

MicroBatch = dict[str, Any]


class PipelineScheduleError(ValueError):
    """A schedule called with arguments it cannot run (unknown engine, no micro-batches)."""


@dataclass
class PipelineStats:
    """What one step kept alive on this stage, measured, not estimated."""

    peak_live_micro_batches: int = 0  # forwarded, backward not yet done
    # Tensors autograd saved for backward, parameters excluded; 0 unless tracked.
    peak_saved_activation_bytes: int = 0


@dataclass
class PipelineStepResult:
    """`loss_tensor`: the mean micro-batch loss (0-d float64, on the device) on the last stage,
    None on the other stages (see `loss_on_all_pp_ranks` to share it)."""

    loss_tensor: torch.Tensor | None
    stats: PipelineStats = field(default_factory=PipelineStats)

    @property
    def loss(self) -> float | None:
        """The loss as a Python float (a host sync)."""
        return None if self.loss_tensor is None else float(self.loss_tensor)


def shape_keys(micro_batches: Sequence[MicroBatch]) -> list[Hashable]:
    """Per micro-batch, the shapes of its tensors: every stage holds the micro-batches, so
    every stage computes the same keys, which p2p uses to agree message shapes once."""
    return [
        tuple((k, tuple(v.shape)) for k, v in sorted(mb.items()) if isinstance(v, torch.Tensor))
        for mb in micro_batches
    ]


class ActivationTracker:
    """Counts live micro-batches and, when `measure_bytes`, the bytes autograd saves for them
    (saved_tensors_hooks)."""

    def __init__(self, stage: nn.Module, measure_bytes: bool = False) -> None:
        self.stats = PipelineStats()
        self.measure_bytes = measure_bytes
        # Storages are told apart by their StorageImpl, not their data pointer: ZeRO-3 releases
        # and re-allocates parameter memory, which moves the pointer but keeps the storage.
        self._param_storages = (
            {_storage_id(p) for p in stage.parameters()} if measure_bytes else set()
        )
        self._bytes_of: dict[Hashable, int] = {}
        self._live_bytes = 0

    def forward(self, stage: nn.Module, x: torch.Tensor | None, batch: MicroBatch, i: Hashable):
        if not self.measure_bytes:
            y = stage(x, batch)
            total = 0
        else:
            y, total = self._measured_forward(stage, x, batch)
        self._bytes_of[i] = total
        self._live_bytes += total
        s = self.stats
        s.peak_live_micro_batches = max(s.peak_live_micro_batches, len(self._bytes_of))
        s.peak_saved_activation_bytes = max(s.peak_saved_activation_bytes, self._live_bytes)
        return y

    def _measured_forward(self, stage, x, batch) -> tuple[torch.Tensor, int]:
        seen: set[int] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            ptr = _storage_id(t)
            if ptr not in self._param_storages and ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = stage(x, batch)
        return y, total

    def backward_done(self, i: Hashable) -> None:
        self._live_bytes -= self._bytes_of.pop(i)


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def accumulate_loss(total: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """Add a last-stage micro-batch loss to the step's sum, on the device (no host sync)."""
    loss = y.detach().double()
    return loss if total is None else total + loss
