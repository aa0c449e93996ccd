"""Pipeline schedules: all-forward-all-backward (AFAB) and one-forward-one-backward (1F1B).

A stage is a module called as `stage(x, batch)`: `x` is the activation received from the
previous stage (None on the first stage) and `batch` the micro-batch dict; the last stage
returns the scalar mean loss of its micro-batch. Each micro-batch loss is divided by the
number of micro-batches m before its backward, so one step's gradients equal those of the mean
loss over the m micro-batches. With pp = 1 both schedules are plain gradient accumulation.
Both are engines of engines.py, which is how callers run them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from nanotron_parallel.pipeline.p2p import StageComm, agreed_shapes
from nanotron_parallel.pipeline.recorder import NO_RECORDER, TimelineRecorder
from nanotron_parallel.pipeline.step import (
    ActivationTracker,
    MicroBatch,
    PipelineScheduleError,
    PipelineStats,
    PipelineStepResult,
    accumulate_loss,
    shape_keys,
)

if TYPE_CHECKING:
    from nanotron_parallel.context import ParallelContext

__all__ = [
    "MicroBatch",
    "PipelineScheduleError",
    "PipelineStats",
    "PipelineStepResult",
    "forward_only",
    "loss_on_all_pp_ranks",
    "train_step_1f1b",
    "train_step_afab",
]


@dataclass
class _StageRun:
    """The per-step state shared by both schedules: forward and backward of one micro-batch."""

    stage: nn.Module
    micro_batches: Sequence[MicroBatch]
    comm: StageComm
    is_last: bool
    on_last_backward: Callable[[], None] | None
    tracker: ActivationTracker
    keys: list[Hashable]  # per micro-batch: the p2p key of its messages
    recorder: TimelineRecorder | object = NO_RECORDER  # the timeline of a recorded step
    inputs: dict[int, torch.Tensor | None] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    loss_sum: torch.Tensor | None = None  # summed on the device: no host sync per micro-batch
    n_backward: int = 0

    def forward(self, i: int, x: torch.Tensor | None) -> torch.Tensor:
        with (
            record_function(f"pp.forward stage={self.comm.stage} mb={i}"),
            self.recorder.span("forward", i, 0),
        ):
            y = self.tracker.forward(self.stage, x, self.micro_batches[i], i)
        if self.is_last:
            self.loss_sum = accumulate_loss(self.loss_sum, y)
            y = y / len(self.micro_batches)  # gradient of the mean loss over micro-batches
        self.inputs[i], self.outputs[i] = x, y
        return y

    def backward(self, i: int, grad_y: torch.Tensor | None) -> torch.Tensor | None:
        x, y = self.inputs.pop(i), self.outputs.pop(i)
        self.n_backward += 1
        if self.n_backward == len(self.micro_batches) and self.on_last_backward is not None:
            self.on_last_backward()
        with (
            record_function(f"pp.backward stage={self.comm.stage} mb={i}"),
            self.recorder.span("backward", i, 0),
        ):
            torch.autograd.backward(y, grad_tensors=grad_y)
        self.tracker.backward_done(i)
        if x is None or not x.requires_grad:
            return None
        # An input this stage does not use still owes the previous stage a gradient.
        return x.grad if x.grad is not None else torch.zeros_like(x)


def _start(
    stage: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    on_last_backward: Callable[[], None] | None,
    track_activations: bool,
    recorder,
) -> _StageRun:
    if len(micro_batches) == 0:
        raise PipelineScheduleError("a pipeline step needs at least one micro-batch, got 0")
    comm = StageComm.from_context(pc, agreed_shapes(stage))
    tracker = ActivationTracker(stage, track_activations)
    keys = shape_keys(micro_batches)
    return _StageRun(
        stage, micro_batches, comm, pc.is_last_stage, on_last_backward, tracker, keys, recorder
    )


def _finish(run: _StageRun) -> PipelineStepResult:
    loss = None
    if run.is_last and run.loss_sum is not None:
        loss = run.loss_sum / len(run.micro_batches)
    return PipelineStepResult(loss, run.tracker.stats)


def train_step_afab(
    stage: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    *,
    on_last_backward: Callable[[], None] | None = None,
    track_activations: bool = False,
    recorder=NO_RECORDER,
) -> PipelineStepResult:
    """All forwards, then all backwards: simple, but every micro-batch's activations stay
    alive until the backward phase starts (m per stage)."""
    run = _start(stage, micro_batches, pc, on_last_backward, track_activations, recorder)
    comm, key, m = run.comm, run.keys, len(micro_batches)
    for i in range(m):
        x = comm.recv_forward(key[i])
        comm.send_forward(run.forward(i, x), key[i])
    for i in range(m):
        grad_y = comm.recv_backward(key[i])
        comm.send_backward(run.backward(i, grad_y), key[i])
    return _finish(run)


def train_step_1f1b(
    stage: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    *,
    on_last_backward: Callable[[], None] | None = None,
    track_activations: bool = False,
    recorder=NO_RECORDER,
) -> PipelineStepResult:
    """One forward, one backward: after a warm-up of pp - rank - 1 forwards every forward is
    followed by a backward, so at most pp - rank micro-batches are alive on this stage.

    Neighbours always make mirrored calls, so the paired exchanges cannot deadlock: with
    W = min(pp - r - 1, m), stage r talks to r + 1 as W sends, m - W send-and-receives, W
    receives, and stage r + 1 talks to r as W receives (its warm-up and the one before the
    steady phase), m - W send-and-receives, W sends. This holds for every m, m < pp included
    (the steady phase is then empty on the first stages).
    """
    run = _start(stage, micro_batches, pc, on_last_backward, track_activations, recorder)
    comm, key, m = run.comm, run.keys, len(micro_batches)
    warmup = min(pc.pp_size - pc.pp_rank - 1, m)
    steady = m - warmup

    for i in range(warmup):
        x = comm.recv_forward(key[i])
        comm.send_forward(run.forward(i, x), key[i])

    x = comm.recv_forward(key[warmup]) if steady > 0 else None
    for k in range(steady):
        fwd, bwd = warmup + k, k
        grad_y = comm.send_forward_recv_backward(run.forward(fwd, x), key[fwd], key[bwd])
        grad_x = run.backward(bwd, grad_y)
        if k == steady - 1:
            comm.send_backward(grad_x, key[bwd])
        else:
            x = comm.send_backward_recv_forward(grad_x, key[bwd], key[fwd + 1])

    for bwd in range(steady, m):
        grad_y = comm.recv_backward(key[bwd])
        comm.send_backward(run.backward(bwd, grad_y), key[bwd])
    return _finish(run)


def forward_only(
    stage: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    weights: Sequence[float],
) -> torch.Tensor | None:
    """Evaluation: the forwards of every micro-batch, nothing kept for a backward.

    Returns sum_i weights[i] * loss_i as a float64 tensor on the device of the last stage
    (None on the other stages); the caller reads it once, so there is no host sync per
    micro-batch. Stage r receives micro-batch i from r - 1 and sends it to r + 1 in the same
    order on every stage, so the transfers pair up one by one and cannot deadlock.
    """
    if len(micro_batches) == 0:
        raise PipelineScheduleError("an evaluation step needs at least one micro-batch, got 0")
    comm = StageComm.from_context(pc, agreed_shapes(stage))
    keys = [("E", k) for k in shape_keys(micro_batches)]  # E: no grad, its own shapes
    total: torch.Tensor | None = None
    with torch.no_grad():
        for i, batch in enumerate(micro_batches):
            x = comm.recv_forward(keys[i])
            with record_function(f"pp.eval_forward stage={comm.stage} mb={i}"):
                y = stage(x, batch)
            if pc.is_last_stage:
                term = y.double() * weights[i]
                total = term if total is None else total + term
            else:
                comm.send_forward(y, keys[i])
    return total


def loss_on_all_pp_ranks(loss: torch.Tensor | float | None, pc: ParallelContext) -> torch.Tensor:
    """The last stage's mean loss on every rank of its pipeline group, as a 0-d float64 device
    tensor (collective over the pp group when pp > 1: every stage calls it). No host sync."""
    if isinstance(loss, torch.Tensor):
        value = loss.detach().to(device=pc.device, dtype=torch.float64).reshape(())
    else:
        value = torch.tensor(0.0 if loss is None else loss, dtype=torch.float64, device=pc.device)
    if pc.pp_size > 1:
        value = value.clone()
        dist.broadcast(value, src=pc.pp_ranks[-1], group=pc.pp_group)
    return value
