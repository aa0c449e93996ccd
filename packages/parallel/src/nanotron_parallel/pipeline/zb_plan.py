"""Plans of the zero-bubble schedules: the order of F, B and W on every rank, simulated.

A backward is split in B (the input gradient, which the previous stage waits for) and W (the
weight gradients, which nobody waits for; tensor_parallel/weight_grad.py). Each rank runs its
own order of F, B and W actions; `simulate` plays every rank's order in lock-step slots of
equal cost (an action runs once its input has arrived, one slot after it was sent) and records
which tensors cross which pair of ranks at the end of each slot. The runner
(zero_bubble.py) executes that plan slot by slot, so the simulation is also the proof that
the order completes: it raises if a slot makes no progress.

- zb-h1 (Qi et al., "Zero Bubble Pipeline Parallelism", handcrafted ZB-H1): one chunk per
  rank. Rank r runs p - r forwards, then for every micro-batch a B, the W of the micro-batch
  r places behind, and the next F; the W left over fill the tail. At most p micro-batches
  are alive on a rank (forwarded, W not yet run): 1F1B's peak (its first rank), which is the
  paper's bound; later stages hold more than under 1F1B. With F = B = W the idle share is
  (p - 1) / (3m + p - 1), a third of 1F1B's (p - 1) / (m + p - 1) in slots, for m >= p.
  Holding every stage to 1F1B's own p - r (`zb-h1-stage-memory`, W right after B) costs
  twice that bubble, 2(p - 1) idle slots per rank, and no order does better: the last stage
  may hold one micro-batch, so it runs F B W in series (3m slots after p - 1 of fill), and
  its last B still has p - 1 stages to cross, each followed by a W.
- zbv (ZB-V): two chunks per rank in a V: chunk 0 of rank r is virtual stage r, chunk 1 is
  virtual stage 2p - 1 - r, so the first rank holds both ends (embedding and loss) and the
  last rank hands its chunk 0's output to its own chunk 1 without a message. Warm-up of
  2(p - r) - 1 chunk-0 forwards, r pairs of forwards, p - r (F, B, W) of chunk 1, then
  F B W of chunk 0 and of chunk 1 in turn, and a cool-down whose W fill the gaps. At most 2p
  chunk-micro-batches (p micro-batches' worth) are alive: 1F1B's activation memory. With
  F = B = W and m >= 2p - 1 no rank idles between its first and last action (the paper's
  zero bubble); a synchronous step still waits (p - 1) chunk-slots for the pipeline to fill.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from nanotron_parallel.pipeline.interleaved import Action, Message, simulate_orders
from nanotron_parallel.pipeline.step import PipelineScheduleError

FWD, BWD, WGT = "F", "B", "W"
VirtualStage = Callable[[int, int, int], int]  # (rank, chunk, pp) -> virtual stage


def straight(rank: int, chunk: int, pp: int) -> int:
    return rank


def v_shape(rank: int, chunk: int, pp: int) -> int:
    return rank if chunk == 0 else 2 * pp - 1 - rank


@dataclass
class ZBPlan:
    pp: int
    m: int
    chunks: int
    slots: list[list[Action | None]]  # slots[t][rank]
    messages: list[list[Message]]  # delivered at the end of slot t (src == dst: a hand-off)

    def idle_share(self) -> float:
        """Idle slots over all slots of the step, the same on every rank here: what a
        synchronous step (the optimizer waits for every rank) loses with F = B = W."""
        idle = sum(1 for slot in self.slots for a in slot if a is None)
        return idle / (len(self.slots) * self.pp)

    def inner_bubble(self, rank: int) -> int:
        """Idle slots between the rank's first and last action (the paper's bubble, which
        is what remains when consecutive steps overlap)."""
        busy = [t for t, slot in enumerate(self.slots) if slot[rank] is not None]
        return busy[-1] - busy[0] + 1 - len(busy)

    def peak_alive(self, rank: int) -> int:
        """The most chunk-micro-batches forwarded and not yet through W on `rank`."""
        alive = peak = 0
        for slot in self.slots:
            a = slot[rank]
            alive += 1 if a is not None and a.kind == FWD else 0
            alive -= 1 if a is not None and a.kind == WGT else 0
            peak = max(peak, alive)
        return peak

    def timeline(self) -> str:
        """One line per rank, one column per slot: F3 = forward of micro-batch 3, f3 its
        second chunk (zbv); B/b and W/w likewise; '.' idle."""
        width = len(str(self.m - 1)) + 1
        lines = []
        for r in range(self.pp):
            cells = []
            for slot in self.slots:
                a = slot[r]
                if a is None:
                    cells.append(".".ljust(width))
                else:
                    kind = a.kind if a.chunk == 0 else a.kind.lower()
                    cells.append(f"{kind}{a.micro_batch}".ljust(width))
            lines.append(f"rank {r}: " + " ".join(cells).rstrip())
        return "\n".join(lines)


def zb_h1_order(pp: int, m: int, rank: int, lag: int | None = None) -> list[Action]:
    """Rank `rank`'s ZB-H1 order: 1F1B's warm-up (p - r forwards), then per micro-batch B,
    a W `lag` micro-batches behind (default r, the paper's), and the next F; the W left over
    fill the tail. The rank holds p - r + lag micro-batches (F to W): lag = r gives every rank
    1F1B's first-stage peak p; lag = 0 gives each stage 1F1B's own p - r."""
    lag = rank if lag is None else lag
    warmup = min(pp - rank, m)
    order = [Action(FWD, i, 0) for i in range(warmup)]
    forwards, weights = warmup, 0
    for b in range(m):
        order.append(Action(BWD, b, 0))
        if b + 1 - weights > lag:
            order.append(Action(WGT, weights, 0))
            weights += 1
        if forwards < m:
            order.append(Action(FWD, forwards, 0))
            forwards += 1
    order += [Action(WGT, i, 0) for i in range(weights, m)]
    return order


def zb_h1_stage_memory_order(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 held to 1F1B's activation memory on every stage (W right after its B). This is
    the best any order can do under that bound: the last stage, holding one micro-batch,
    runs F B W in series, so each rank idles 2(p - 1) slots, not the paper's p - 1."""
    return zb_h1_order(pp, m, rank, lag=0)


def zbv_order(pp: int, m: int, rank: int) -> list[Action]:
    """The ZB-V order, written for n = max(m, 2p - 1) micro-batches (the full pattern) and
    then stripped of those past m (the simulation lets what remains wait for its inputs)."""
    n = max(m, 2 * pp - 1)
    count = {(k, c): 0 for k in (FWD, BWD, WGT) for c in (0, 1)}
    order: list[Action] = []

    def run(kind: str, chunk: int, times: int = 1) -> None:
        for _ in range(times):
            order.append(Action(kind, count[kind, chunk], chunk))
            count[kind, chunk] += 1

    run(FWD, 0, 2 * (pp - rank) - 1)
    for _ in range(rank):
        run(FWD, 1)
        run(FWD, 0)
    for _ in range(pp - rank):
        run(FWD, 1)
        run(BWD, 1)
        run(WGT, 1)
    while count[FWD, 0] < n or count[FWD, 1] < count[FWD, 0]:
        if count[FWD, 0] < n:
            run(FWD, 0)
        for chunk in (0, 1):
            if chunk == 1:
                run(FWD, 1)
            run(BWD, chunk)
            run(WGT, chunk)
    for _ in range(rank):
        run(BWD, 0)
        run(BWD, 1)
    for _ in range(pp - rank):
        run(BWD, 0)
        run(WGT, 0)
    run(WGT, 1, count[BWD, 1] - count[WGT, 1])
    run(WGT, 0, count[BWD, 0] - count[WGT, 0])
    return [a for a in order if a.micro_batch < m]


@dataclass(frozen=True)
class ZBSchedule:
    name: str
    chunks: int
    order: Callable[[int, int, int], list[Action]]
    virtual_stage: VirtualStage


SCHEDULES = {
    "zb-h1": ZBSchedule("zb-h1", 1, zb_h1_order, straight),
    "zbv": ZBSchedule("zbv", 2, zbv_order, v_shape),
    # planner only (bench/zero_bubble.py): the price of 1F1B's memory on every stage
    "zb-h1-stage-memory": ZBSchedule("zb-h1-stage-memory", 1, zb_h1_stage_memory_order, straight),
}


def plan(name: str, pp: int, m: int, forward_only: bool = False) -> ZBPlan:
    """The simulated plan of schedule `name` for pp ranks and m micro-batches."""
    if m < 1 or pp < 1:
        raise PipelineScheduleError(f"a {name} plan needs pp >= 1 and m >= 1, got {pp}, {m}")
    sched = SCHEDULES[name]
    orders = [sched.order(pp, m, r) for r in range(pp)]
    if forward_only:
        orders = [[a for a in order if a.kind == FWD] for order in orders]
    return simulate(pp, m, sched.chunks, orders, sched.virtual_stage)


def simulate(
    pp: int, m: int, chunks: int, orders: list[list[Action]], vstage: VirtualStage
) -> ZBPlan:
    what = f"the zero-bubble plan (pp={pp}, m={m})"
    return ZBPlan(pp, m, chunks, *simulate_orders(pp, chunks, orders, vstage, what))


def idle_formula(engine: str, pp: int, m: int, v: int = 2) -> float:
    """The planned idle share of a synchronous step with F = B = W, by schedule: 1F1B and
    interleaved 1F1B (v chunks) from their bubbles, the zero-bubble ones from their plans
    (tests check the plans give exactly these for m >= p, and m >= 2p - 1 for zbv)."""
    formulas = {
        "1f1b": lambda: (pp - 1) / (m + pp - 1),
        "interleaved-1f1b": lambda: (pp - 1) / (v * m + pp - 1),
        "zb-h1": lambda: (pp - 1) / (3 * m + pp - 1),
        "zb-h1-stage-memory": lambda: 2 * (pp - 1) / (3 * m + 2 * (pp - 1)),
        "zbv": lambda: (pp - 1) / (6 * m + pp - 1),  # chunk slots: half a stage each
    }
    return formulas[engine]()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print a zero-bubble schedule's timeline.")
    parser.add_argument("--engine", choices=sorted(SCHEDULES), default="zb-h1")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("-m", "--micro-batches", type=int, default=8)
    args = parser.parse_args(argv)
    p = plan(args.engine, args.pp, args.micro_batches)
    print(p.timeline())
    inner = [p.inner_bubble(r) for r in range(p.pp)]
    print(
        f"{args.engine} pp={p.pp} m={p.m}: {len(p.slots)} slots, idle share "
        f"{p.idle_share():.3f} (formula {idle_formula(args.engine, p.pp, p.m):.3f}), "
        f"idle inside each rank's span {inner}, peak alive {[p.peak_alive(r) for r in range(p.pp)]}"
    )


if __name__ == "__main__":
    main()
