"""Interleaved 1F1B: v model chunks per pipeline rank, a bubble v times smaller.

The model is cut into V = pp * v virtual stages; rank r holds chunks c = 0 .. v-1, chunk c being
virtual stage c * pp + r. A micro-batch therefore goes round the ring of ranks v times, and
activations flow rank r -> r + 1, with the last rank's chunk c feeding the first rank's chunk
c + 1. Each rank runs its forwards (F) and backwards (B) in the order of Megatron-LM's
interleaved schedule (see `rank_order`). Its bubble is (p - 1) / (v * m) of the ideal step
against (p - 1) / m for plain 1F1B (idle share of the step: (p - 1) / (v * m + p - 1)); the price is more activations alive (warm-up grows by
(v - 1) * p units of 1/v of a stage each) and v times more p2p messages.

Execution is planned, then run. `plan_interleaved` simulates every rank's order in lock-step
slots (one F or B per slot, an action runs once its input has arrived) and records, for each
slot, which tensors cross which pair of ranks. Every rank computes the same plan, so each runs
its slots in turn and, after its action of a slot, posts exactly the sends and receives the
plan gives it for that slot, batched (`exchange_many`). The peers of a slot post the mirrored
operations in the same slot, which makes the communication deadlock-free by construction on
gloo and NCCL alike, and the simulation itself proves the order can complete (it raises if a
slot makes no progress).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.profiler import record_function

from nanotron_parallel.pipeline.p2p import agreed_shapes, exchange_many
from nanotron_parallel.pipeline.recorder import NO_RECORDER
from nanotron_parallel.pipeline.step import (
    ActivationTracker,
    MicroBatch,
    PipelineScheduleError,
    PipelineStepResult,
    accumulate_loss,
    shape_keys,
)

if TYPE_CHECKING:
    from nanotron_parallel.context import ParallelContext

FWD, BWD = "F", "B"


@dataclass(frozen=True)
class Action:
    kind: str  # FWD or BWD
    micro_batch: int
    chunk: int


@dataclass(frozen=True)
class Message:
    """One tensor crossing from rank `src` to rank `dst` (pp ranks) at the end of a slot:
    an activation (FWD) or an input gradient (BWD) for `dst`'s (micro_batch, chunk)."""

    kind: str
    src: int
    dst: int
    micro_batch: int
    chunk: int  # the receiving chunk on dst


@dataclass
class InterleavedPlan:
    pp: int
    v: int
    m: int
    slots: list[list[Action | None]]  # slots[t][rank]
    messages: list[list[Message]]  # messages[t]: delivered at the end of slot t

    def idle_fraction(self, rank: int) -> float:
        """Share of the slots in which `rank` computes nothing (the simulated bubble)."""
        idle = sum(1 for slot in self.slots if slot[rank] is None)
        return idle / len(self.slots)


def check_interleaved(pp: int, v: int, m: int) -> None:
    if v < 1:
        raise PipelineScheduleError(f"parallelism.pp_virtual_stages must be >= 1, got {v}")
    if m < 1 or m % pp != 0:
        raise PipelineScheduleError(
            f"the interleaved-1f1b engine needs the number of micro-batches ({m}, "
            f"tokens.batch_accumulation_per_replica) to be a multiple of parallelism.pp={pp}"
        )


def rank_order(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """The order in which `rank` runs its m * v forwards and backwards.

    Unit k (0 .. m*v - 1) of the forward sequence is micro-batch (k // (p*v)) * p + k % p on
    chunk (k // p) % v: groups of p micro-batches go through chunk 0, then the same group
    through chunk 1, and so on. Backwards visit the chunks in reverse. Warm-up runs
    (p - r - 1) * 2 + (v - 1) * p forwards, then one forward and one backward alternate, then the
    cool-down runs the remaining backwards. For p = 2, v = 2, m = 4 (F/B micro-batch.chunk):

        rank 0: F0.0 F1.0 F0.1 F1.1 | F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 | B2.1 B3.1 B2.0 B3.0
        rank 1: F0.0 F1.0 | F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 | B2.0 B3.0
    """
    total = m * v

    def unit(k: int, forward: bool) -> Action:
        chunk = (k // pp) % v
        mb = (k // (pp * v)) * pp + k % pp
        return Action(FWD, mb, chunk) if forward else Action(BWD, mb, v - 1 - chunk)

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [unit(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [unit(warmup + k, True), unit(k, False)]
    order += [unit(k, False) for k in range(total - warmup, total)]
    return order


def plan_interleaved(pp: int, v: int, m: int) -> InterleavedPlan:
    """Simulate all ranks' orders in lock-step slots; see the module docstring."""
    check_interleaved(pp, v, m)
    return _simulate(pp, v, m, [rank_order(pp, v, m, r) for r in range(pp)])


def plan_forward_only(pp: int, v: int, m: int) -> InterleavedPlan:
    """The plan of an evaluation: each rank's forwards in the training order, no backward."""
    check_interleaved(pp, v, m)
    orders = [[a for a in rank_order(pp, v, m, r) if a.kind == FWD] for r in range(pp)]
    return _simulate(pp, v, m, orders)


def _simulate(pp: int, v: int, m: int, orders: list[list[Action]]) -> InterleavedPlan:
    slots, messages = simulate_orders(
        pp, v, orders, lambda r, c, p: c * p + r, f"interleaved plan (pp={pp}, v={v}, m={m})"
    )
    return InterleavedPlan(pp, v, m, slots, messages)


def simulate_orders(
    pp: int,
    chunks: int,
    orders: list[list[Action]],
    virtual_stage: Callable[[int, int, int], int],
    what: str,
) -> tuple[list[list[Action | None]], list[list[Message]]]:
    """Each rank's `orders` run in lockstep slots: an action waits for the message it needs
    (a forward past the first virtual stage, a backward before the last; any other kind, a
    zero-bubble W, needs none), then sends to the neighbouring virtual stage, whose rank and
    chunk `virtual_stage(rank, chunk, pp)` places. Returns (slots, messages sent per slot);
    a slot where no rank can move is a deadlock of the orders: an error naming `what`."""
    last = pp * chunks - 1
    where = {virtual_stage(r, c, pp): (r, c) for r in range(pp) for c in range(chunks)}
    arrived: set[tuple[str, int, int, int]] = set()  # (kind, rank, micro_batch, chunk)
    pos = [0] * pp
    slots: list[list[Action | None]] = []
    messages: list[list[Message]] = []
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        row: list[Action | None] = []
        sent: list[Message] = []
        for r in range(pp):
            a = orders[r][pos[r]] if pos[r] < len(orders[r]) else None
            vs = None if a is None else virtual_stage(r, a.chunk, pp)
            needs = a is not None and (vs > 0 if a.kind == FWD else a.kind == BWD and vs < last)
            if a is None or (needs and (a.kind, r, a.micro_batch, a.chunk) not in arrived):
                row.append(None)
                continue
            row.append(a)
            pos[r] += 1
            if a.kind == FWD and vs < last:  # activation to the next virtual stage
                dst, chunk = where[vs + 1]
                sent.append(Message(FWD, r, dst, a.micro_batch, chunk))
            elif a.kind == BWD and vs > 0:  # input gradient to the previous virtual stage
                dst, chunk = where[vs - 1]
                sent.append(Message(BWD, r, dst, a.micro_batch, chunk))
        if all(a is None for a in row):
            raise PipelineScheduleError(f"{what} stalls")
        arrived.update((msg.kind, msg.dst, msg.micro_batch, msg.chunk) for msg in sent)
        slots.append(row)
        messages.append(sent)
    return slots, messages


@dataclass
class _ChunkRun:
    """This rank's state during one interleaved step."""

    chunks: Sequence[nn.Module]
    micro_batches: Sequence[MicroBatch]
    rank: int
    pp: int
    tracker: ActivationTracker
    on_last_backward: Callable[[], None] | None
    recorder: object = NO_RECORDER  # TimelineRecorder on the recorded step
    inputs: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    received: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    loss_sum: torch.Tensor | None = None
    n_backward: int = 0

    def is_last_virtual(self, chunk: int) -> bool:
        return chunk == len(self.chunks) - 1 and self.rank == self.pp - 1

    def forward(self, mb: int, chunk: int) -> torch.Tensor:
        x = self.received.pop((FWD, mb, chunk), None)
        vs = chunk * self.pp + self.rank
        with (
            record_function(f"pp.forward stage={vs} mb={mb}"),
            self.recorder.span("forward", mb, chunk),
        ):
            y = self.tracker.forward(self.chunks[chunk], x, self.micro_batches[mb], (mb, chunk))
        if self.is_last_virtual(chunk):
            self.loss_sum = accumulate_loss(self.loss_sum, y)
            y = y / len(self.micro_batches)
        self.inputs[mb, chunk], self.outputs[mb, chunk] = x, y
        return y

    def backward(self, mb: int, chunk: int) -> torch.Tensor | None:
        grad_y = self.received.pop((BWD, mb, chunk), None)
        x, y = self.inputs.pop((mb, chunk)), self.outputs.pop((mb, chunk))
        self.n_backward += 1
        if self.n_backward == len(self.micro_batches) * len(self.chunks) and self.on_last_backward:
            self.on_last_backward()
        with (
            record_function(f"pp.backward stage={chunk * self.pp + self.rank} mb={mb}"),
            self.recorder.span("backward", mb, chunk),
        ):
            torch.autograd.backward(y, grad_tensors=grad_y)
        self.tracker.backward_done((mb, chunk))
        if x is None or not x.requires_grad:
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)


def train_step_interleaved_1f1b(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    *,
    on_last_backward: Callable[[], None] | None = None,
    track_activations: bool = False,
    recorder=NO_RECORDER,
) -> PipelineStepResult:
    """One training step with the interleaved 1F1B schedule. `model.chunks` lists this rank's
    v chunks (chunk c = virtual stage c * pp + pp_rank), each called as `chunk(x, batch)`."""
    chunks = list(getattr(model, "chunks", [model]))
    pp, rank = pc.pp_size, pc.pp_rank
    plan = plan_interleaved(pp, len(chunks), len(micro_batches))
    keys = shape_keys(micro_batches)  # p2p shapes are agreed once per key (see p2p.py)
    tracker = ActivationTracker(nn.ModuleList(chunks), track_activations)
    run = _ChunkRun(chunks, micro_batches, rank, pp, tracker, on_last_backward, recorder)
    for slot, sent in zip(plan.slots, plan.messages):
        out: dict[str, torch.Tensor | None] = {}
        action = slot[rank]
        if action is not None:
            if action.kind == FWD:
                out[FWD] = run.forward(action.micro_batch, action.chunk)
            else:
                out[BWD] = run.backward(action.micro_batch, action.chunk)
        for msg in sent:
            if msg.src == rank == msg.dst:  # pp = 1: the ring is this rank, hand over locally
                t = out[msg.kind]
                assert t is not None
                local = t.detach().requires_grad_(t.requires_grad) if msg.kind == FWD else t
                run.received[msg.kind, msg.micro_batch, msg.chunk] = local
        sent = [msg for msg in sent if msg.src != msg.dst]
        mine = [msg for msg in sent if msg.src == rank]  # at most one
        theirs = sorted((msg for msg in sent if msg.dst == rank), key=lambda msg: msg.kind)
        if not mine and not theirs:
            continue
        sends = []
        for msg in mine:
            t = out[msg.kind]
            if t is None:  # an unused input still owes its stage a gradient
                raise PipelineScheduleError(f"nothing to send for {msg}")
            sends.append((t, pc.pp_ranks[msg.dst], _key(msg, keys)))
        recvs = [(pc.pp_ranks[msg.src], _key(msg, keys)) for msg in theirs]
        with record_function("pp.p2p"):
            got = exchange_many(sends, recvs, pc.pp_group, pc.device, agreed_shapes(model))
        for msg, t in zip(theirs, got):
            run.received[msg.kind, msg.micro_batch, msg.chunk] = t
    loss = None if run.loss_sum is None else run.loss_sum / len(micro_batches)
    return PipelineStepResult(loss, tracker.stats)


def forward_only_interleaved(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    pc: ParallelContext,
    weights: Sequence[float],
) -> torch.Tensor | None:
    """Evaluation with v chunks per rank: the forwards of `plan_forward_only`, without autograd.
    Returns sum_i weights[i] * loss_i (float64, on the device) on the rank holding the last
    virtual stage, None elsewhere, like `schedules.forward_only`."""
    chunks = list(getattr(model, "chunks", [model]))
    pp, rank, v = pc.pp_size, pc.pp_rank, len(chunks)
    plan = plan_forward_only(pp, v, len(micro_batches))
    shapes = shape_keys(micro_batches)  # p2p shapes agreed once per key (see p2p.py)
    received: dict[tuple[int, int], torch.Tensor] = {}
    total: torch.Tensor | None = None
    with torch.no_grad():
        for slot, sent in zip(plan.slots, plan.messages):
            action, y = slot[rank], None
            if action is not None:
                mb, chunk = action.micro_batch, action.chunk
                x = received.pop((mb, chunk), None)
                with record_function(f"pp.eval_forward stage={chunk * pp + rank} mb={mb}"):
                    y = chunks[chunk](x, micro_batches[mb])
                if chunk == v - 1 and rank == pp - 1:  # the last virtual stage: a loss
                    term = y.double() * weights[mb]
                    total = term if total is None else total + term
            sends, recvs, keys = [], [], []
            for msg in sent:
                if msg.src == rank == msg.dst:  # pp = 1: hand over locally
                    received[msg.micro_batch, msg.chunk] = y
                elif msg.src == rank:
                    key = ("E", msg.chunk, shapes[msg.micro_batch])  # E: no grad, own shapes
                    sends.append((y, pc.pp_ranks[msg.dst], key))
                elif msg.dst == rank:
                    key = ("E", msg.chunk, shapes[msg.micro_batch])
                    recvs.append((pc.pp_ranks[msg.src], key))
                    keys.append((msg.micro_batch, msg.chunk))
            if sends or recvs:
                with record_function("pp.p2p"):
                    agreed = agreed_shapes(model)
                    got = exchange_many(sends, recvs, pc.pp_group, pc.device, agreed)
                received.update(zip(keys, got))
    return total


def _key(msg: Message, keys: list) -> tuple:
    """The p2p key of a message: what it carries and for which chunk, and the shapes of its
    micro-batch (the same on the sending and the receiving rank)."""
    return (msg.kind, msg.chunk, keys[msg.micro_batch])
