"""The zero-bubble engines, zb-h1 and zbv: the plan of zb_plan.py run slot by slot.

Each slot, this rank runs its action of the plan (F, B or W of one micro-batch and chunk),
then posts, batched (`exchange_many`), exactly the sends and receives the plan gives it for
that slot. The plan is computed alike on every rank, so the peers of a slot post mirrored
operations in the same slot: no deadlock, on gloo and NCCL alike (the argument of
interleaved.py), and the simulation proves the orders complete. A hand-off between two
chunks of the same rank (zbv's turn of the V on the last rank) is passed locally.

B runs the backward under `deferring`: the layers with a split queue their weight gradients
(tensor_parallel/weight_grad.py) and autograd returns, without accumulating them, the
gradients of the other parameters; W runs the queue and accumulates everything. So every
gradient lands in W, and `on_last_backward` (data parallelism arming its buckets, ZeRO
included; tied gradients are summed after the step) is called before this rank's last W, not
its last B. Activation checkpointing composes: the recomputation runs once, in B, and W keeps
what it needs. A micro-batch counts as alive from its F to its W.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.profiler import record_function

from nanotron_parallel.pipeline.interleaved import Message
from nanotron_parallel.pipeline.p2p import agreed_shapes, exchange_many
from nanotron_parallel.pipeline.recorder import NO_RECORDER
from nanotron_parallel.pipeline.step import (
    ActivationTracker,
    MicroBatch,
    PipelineStepResult,
    accumulate_loss,
    shape_keys,
)
from nanotron_parallel.pipeline.zb_plan import BWD, FWD, SCHEDULES, plan
from nanotron_parallel.tensor_parallel.weight_grad import (
    deferring,
    run_weight_grads,
    weight_grad_split,
)

if TYPE_CHECKING:
    from nanotron_parallel.context import ParallelContext


@dataclass
class _ZBRun:
    chunks: Sequence[nn.Module]
    micro_batches: Sequence[MicroBatch]
    last_chunk: int | None  # the chunk holding the loss on this rank, if any
    tracker: ActivationTracker
    on_last_backward: Callable[[], None] | None
    n_weights: int  # W actions of this rank in the step
    names: list[str]  # per chunk, its virtual stage for profiler labels
    recorder: object = NO_RECORDER
    params: list[list[nn.Parameter]] = field(default_factory=list)
    received: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    saved: dict[tuple[int, int], tuple] = field(default_factory=dict)
    pending: dict[tuple[int, int], tuple] = field(default_factory=dict)
    loss_sum: torch.Tensor | None = None
    weights_done: int = 0

    def forward(self, mb: int, chunk: int) -> torch.Tensor:
        x = self.received.pop((FWD, mb, chunk), None)
        with (
            record_function(f"pp.forward stage={self.names[chunk]} mb={mb}"),
            self.recorder.span("forward", mb, chunk),
        ):
            y = self.tracker.forward(self.chunks[chunk], x, self.micro_batches[mb], (mb, chunk))
        if chunk == self.last_chunk:
            self.loss_sum = accumulate_loss(self.loss_sum, y)
            y = y / len(self.micro_batches)
        self.saved[mb, chunk] = (x, y)
        return y

    def backward_input(self, mb: int, chunk: int) -> torch.Tensor | None:
        grad_y = self.received.pop((BWD, mb, chunk), None)
        x, y = self.saved.pop((mb, chunk))
        takes_grad = x is not None and x.requires_grad
        inputs = ([x] if takes_grad else []) + self.params[chunk]
        jobs: list = []
        with (
            record_function(f"pp.backward stage={self.names[chunk]} mb={mb}"),
            self.recorder.span("backward", mb, chunk),
            deferring(jobs),
        ):
            grads = torch.autograd.grad(y, inputs, grad_y, allow_unused=True)
        grads = list(grads)
        grad_x = grads.pop(0) if takes_grad else None
        extra = [(p, g) for p, g in zip(self.params[chunk], grads) if g is not None]
        self.pending[mb, chunk] = (jobs, extra)
        if takes_grad and grad_x is None:  # an input this chunk does not use owes zeros
            grad_x = torch.zeros_like(x)
        return grad_x

    def backward_weight(self, mb: int, chunk: int) -> None:
        jobs, extra = self.pending.pop((mb, chunk))
        self.weights_done += 1
        if self.weights_done == self.n_weights and self.on_last_backward is not None:
            self.on_last_backward()  # every gradient of the step lands in this rank's W
        with (
            record_function(f"pp.weight stage={self.names[chunk]} mb={mb}"),
            self.recorder.span("W", mb, chunk),
        ):
            run_weight_grads(jobs, extra)
        self.tracker.backward_done((mb, chunk))


def train_step_zero_bubble(
    name: str,
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    *,
    on_last_backward: Callable[[], None] | None = None,
    track_activations: bool = False,
    recorder=NO_RECORDER,
) -> PipelineStepResult:
    """One training step of zero-bubble schedule `name` (zb-h1: `model` is this rank's stage;
    zbv: `model.chunks` are its two chunks, virtual stages r and 2p - 1 - r)."""
    sched = SCHEDULES[name]
    chunks = list(getattr(model, "chunks", [model]))
    pp, rank = pc.pp_size, pc.pp_rank
    if len(chunks) != sched.chunks:
        raise ValueError(
            f"the {name} engine runs {sched.chunks} chunk(s) per rank, got {len(chunks)}"
        )
    zb = plan(name, pp, len(micro_batches))
    stages = [sched.virtual_stage(rank, c, pp) for c in range(len(chunks))]
    last = stages.index(pp * len(chunks) - 1) if pp * len(chunks) - 1 in stages else None
    n_weights = sum(1 for slot in zb.slots if slot[rank] is not None and slot[rank].kind == "W")
    tracker = ActivationTracker(nn.ModuleList(chunks), track_activations)
    run = _ZBRun(
        chunks, micro_batches, last, tracker, on_last_backward, n_weights,
        [str(s) for s in stages], recorder,
    )  # fmt: skip
    run.params = [[p for p in c.parameters() if p.requires_grad] for c in chunks]
    keys = shape_keys(micro_batches)
    with weight_grad_split():
        for slot, sent in zip(zb.slots, zb.messages):
            out: dict[str, torch.Tensor | None] = {}
            action = slot[rank]
            if action is not None:
                mb, chunk = action.micro_batch, action.chunk
                if action.kind == FWD:
                    out[FWD] = run.forward(mb, chunk)
                elif action.kind == BWD:
                    out[BWD] = run.backward_input(mb, chunk)
                else:
                    run.backward_weight(mb, chunk)
            _deliver(run, out, sent, pc, keys, model)
    loss = None if run.loss_sum is None else run.loss_sum / len(micro_batches)
    n = pp * sched.chunks
    if all(sched.virtual_stage(pp - 1, c, pp) != n - 1 for c in range(sched.chunks)):
        loss = _to_last_stage(loss, pc, last is not None)  # the loss is not on the last rank
    return PipelineStepResult(loss, tracker.stats)


def _to_last_stage(value: torch.Tensor | None, pc, holds: bool) -> torch.Tensor | None:
    """zbv computes the loss on the first rank (both ends of the V); callers read it on the
    last stage, as under every other engine: one broadcast over the pp group, no host sync."""
    if pc.pp_size == 1:
        return value
    out = (
        value.detach().clone() if holds else torch.zeros((), dtype=torch.float64, device=pc.device)
    )
    torch.distributed.broadcast(out, src=pc.pp_ranks[0], group=pc.pp_group)
    return out if pc.is_last_stage else None


def _deliver(run: _ZBRun, out: dict, sent: list[Message], pc, keys, model) -> None:
    """The messages of one slot that concern this rank: local hand-offs, then one batched
    exchange of its sends and receives (the same list, in the same order, on the peer)."""
    rank = pc.pp_rank
    for msg in sent:
        if msg.src == rank == msg.dst:
            t = out[msg.kind]
            local = t.detach().requires_grad_(t.requires_grad) if msg.kind == FWD else t
            run.received[msg.kind, msg.micro_batch, msg.chunk] = local
    sent = [msg for msg in sent if msg.src != msg.dst]
    mine = [msg for msg in sent if msg.src == rank]
    theirs = sorted((msg for msg in sent if msg.dst == rank), key=lambda msg: msg.kind)
    if not mine and not theirs:
        return
    sends = [(out[msg.kind], pc.pp_ranks[msg.dst], _key(msg, keys)) for msg in mine]
    recvs = [(pc.pp_ranks[msg.src], _key(msg, keys)) for msg in theirs]
    with record_function("pp.p2p"):
        got = exchange_many(sends, recvs, pc.pp_group, pc.device, agreed_shapes(model))
    for msg, t in zip(theirs, got):
        run.received[msg.kind, msg.micro_batch, msg.chunk] = t


def _key(msg: Message, keys: list) -> tuple:
    return ("ZB", msg.kind, msg.chunk, keys[msg.micro_batch])


def forward_only_zbv(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    weights: Sequence[float],
) -> torch.Tensor | None:
    """Evaluation in the V layout: the forwards of the zbv plan, no autograd. Returns
    sum_i weights[i] * loss_i (float64, on the device) on the last stage (computed on the
    first rank, which holds the last virtual stage, and handed over), None elsewhere."""
    chunks = list(getattr(model, "chunks", [model]))
    zb = plan("zbv", pc.pp_size, len(micro_batches), forward_only=True)
    keys = [("E", k) for k in shape_keys(micro_batches)]  # E: no grad, its own shapes
    run = _EvalRun(chunks, micro_batches, pc.pp_rank == 0, weights)
    with torch.no_grad():
        for slot, sent in zip(zb.slots, zb.messages):
            action = slot[pc.pp_rank]
            out = {} if action is None else {FWD: run.forward(action.micro_batch, action.chunk)}
            _deliver(run, out, sent, pc, keys, model)  # type: ignore[arg-type]
    return _to_last_stage(run.total, pc, run.holds_loss)


@dataclass
class _EvalRun:
    chunks: Sequence[nn.Module]
    micro_batches: Sequence[MicroBatch]
    holds_loss: bool
    weights: Sequence[float]
    received: dict = field(default_factory=dict)
    total: torch.Tensor | None = None

    def forward(self, mb: int, chunk: int) -> torch.Tensor:
        x = self.received.pop((FWD, mb, chunk), None)
        with record_function(f"pp.eval_forward chunk={chunk} mb={mb}"):
            y = self.chunks[chunk](x, self.micro_batches[mb])
        if self.holds_loss and chunk == 1:
            term = y.double() * self.weights[mb]
            self.total = term if self.total is None else self.total + term
        return y
