"""The pipeline engines by name: the one table every caller reads instead of comparing names.

An engine is its training step, its forward-only step (evaluation), whether it runs several
model chunks per rank (`parallelism.pp_virtual_stages`), how many micro-batches a stage keeps
alive at most (the memory estimate), the span kinds its timeline records, and the facts config
checks need. A new schedule is one module with its two steps plus one row in `ENGINES`.

zb-h1 and zbv (zero_bubble.py, planned in zb_plan.py) split each backward in B and W. Their
no-deadlock argument is interleaved 1F1B's: every rank computes the same simulated plan and,
after its action of a slot, posts exactly the mirrored sends and receives of that slot, batched;
the simulation raises if the orders cannot complete. They refuse, at config time, ZeRO-3 (it
frees gathered weights after each block's backward, before W has used them), torch.compile of
the layers (the W queue is Python state a compiled backward cannot reach) and context
parallelism (not verified yet). zbv's first rank holds both ends of the V: the runner hands
the loss to the last rank, where every caller reads it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from nanotron_parallel.pipeline.interleaved import (
    forward_only_interleaved,
    train_step_interleaved_1f1b,
)
from nanotron_parallel.pipeline.recorder import NO_RECORDER
from nanotron_parallel.pipeline.schedules import forward_only, train_step_1f1b, train_step_afab
from nanotron_parallel.pipeline.step import MicroBatch, PipelineScheduleError, PipelineStepResult
from nanotron_parallel.pipeline.zb_plan import idle_formula, v_shape
from nanotron_parallel.pipeline.zero_bubble import forward_only_zbv, train_step_zero_bubble

if TYPE_CHECKING:
    from nanotron_parallel.context import ParallelContext


@dataclass(frozen=True)
class PipelineEngine:
    """One schedule.

    `uses_virtual_stages`: a rank holds `pp_virtual_stages` chunks (else exactly one, and
    `pp_virtual_stages` must be 1); `in_flight(m, pp)`: the most micro-batches a stage holds
    activations for; `micro_batches_multiple_of_pp`: a step needs m divisible by pp;
    `gathers_in_stage_order`: a stage's forward calls its blocks in order (ZeRO-3 prefetches
    the next block on that assumption); `span_kinds`: what its timeline spans are called;
    `fixed_chunks`: chunks per rank whatever pp_virtual_stages says (zbv: 2);
    `splits_backward`: B and W run apart (what ZeRO-3, compile and cp cannot follow yet);
    `stage_of(rank, chunk, pp)`: the virtual stage of a rank's chunk (interleaved: chunk * pp +
    rank; zbv: the V); `planned_idle(pp, m, chunks)`: the idle share of a step with equal costs
    (what telemetry reports beside the measured bubble).
    """

    name: str
    train_step: Callable[..., PipelineStepResult]
    forward_only: Callable[..., torch.Tensor | None]
    in_flight: Callable[[int, int], int]
    uses_virtual_stages: bool = False
    micro_batches_multiple_of_pp: bool = False
    gathers_in_stage_order: bool = True
    span_kinds: tuple[str, ...] = ("forward", "backward")
    fixed_chunks: int = 0
    splits_backward: bool = False
    stage_of: Callable[[int, int, int], int] = lambda rank, chunk, pp: chunk * pp + rank
    planned_idle: Callable[[int, int, int], float] = lambda pp, m, v: (pp - 1) / (v * m + pp - 1)

    def chunks(self, virtual_stages: int) -> int:
        """Model chunks per rank for `parallelism.pp_virtual_stages` = virtual_stages."""
        if self.fixed_chunks:
            return self.fixed_chunks
        return virtual_stages if self.uses_virtual_stages else 1

    def last_stage_rank(self, pp: int, chunks: int) -> int:
        """The pp rank holding the last virtual stage (the loss): pp - 1, or 0 under zbv."""
        last = pp * chunks - 1
        return next(r for r in range(pp) for c in range(chunks) if self.stage_of(r, c, pp) == last)


ENGINES: dict[str, PipelineEngine] = {
    "afab": PipelineEngine(
        "afab",
        train_step_afab,
        forward_only,
        in_flight=lambda m, pp: m,  # every forward before the first backward
    ),
    "1f1b": PipelineEngine(
        "1f1b",
        train_step_1f1b,
        forward_only,
        in_flight=lambda m, pp: min(m, pp),  # the first stage's warm-up, plus one
    ),
    "interleaved-1f1b": PipelineEngine(
        "interleaved-1f1b",
        train_step_interleaved_1f1b,
        forward_only_interleaved,
        in_flight=lambda m, pp: min(m, 2 * pp),  # a longer warm-up, over v chunks
        uses_virtual_stages=True,
        micro_batches_multiple_of_pp=True,
        gathers_in_stage_order=False,
    ),
    "zb-h1": PipelineEngine(
        "zb-h1",
        functools.partial(train_step_zero_bubble, "zb-h1"),
        forward_only,
        in_flight=lambda m, pp: min(m, pp),  # every rank holds up to 1F1B's first-stage peak
        span_kinds=("forward", "backward", "W"),
        splits_backward=True,
        planned_idle=lambda pp, m, v: idle_formula("zb-h1", pp, m),
    ),
    "zbv": PipelineEngine(
        "zbv",
        functools.partial(train_step_zero_bubble, "zbv"),
        forward_only_zbv,
        in_flight=lambda m, pp: min(m, pp),  # 2p half-stage chunks: 1F1B's peak
        span_kinds=("forward", "backward", "W"),
        fixed_chunks=2,
        gathers_in_stage_order=False,
        splits_backward=True,
        stage_of=v_shape,
        planned_idle=lambda pp, m, v: idle_formula("zbv", pp, m),
    ),
}


def engine(name: str) -> PipelineEngine:
    """The engine called `name`; an unknown one is an error naming the config key."""
    if name not in ENGINES:
        raise PipelineScheduleError(
            f"parallelism.pp_engine must be one of {sorted(ENGINES)}, got {name!r}"
        )
    return ENGINES[name]


def run_pipeline_step(
    engine_name: str,
    stage: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    *,
    on_last_backward: Callable[[], None] | None = None,
    track_activations: bool = False,
    recorder=NO_RECORDER,
) -> PipelineStepResult:
    """Run one training step's forwards and backwards with the named engine.
    `track_activations` measures the saved-activation bytes (hooks on every forward);
    `recorder` (a TimelineRecorder, for the one step it records) times each forward and
    backward per micro-batch and chunk (pipeline/recorder.py)."""
    return engine(engine_name).train_step(
        stage,
        micro_batches,
        pc,
        on_last_backward=on_last_backward,
        track_activations=track_activations,
        recorder=recorder,
    )


def run_forward_only(
    engine_name: str,
    stage: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    weights: Sequence[float],
) -> torch.Tensor | None:
    """The forward-only twin of `run_pipeline_step`: the model layout of the engine, no grads."""
    return engine(engine_name).forward_only(stage, micro_batches, pc, weights)
