"""Pipeline bubble on the CPU: measured idle fraction per stage against the formula.

pp = 4 gloo processes (one thread each), m = 8 micro-batches; for afab, 1f1b and
interleaved-1f1b (v = 2) every stage runs the same toy MLP work (interleaved: the same layers
split in two chunks). Idle = time blocked in pipeline p2p calls (timers wrapped around
`p2p.exchange` and `interleaved.exchange_many`) / step time, median over the measured steps.
Formula: (p - 1) / (m + p - 1), and (p - 1) / (v * m + p - 1) interleaved, i.e. a bubble of
(p - 1) / m and (p - 1) / (v * m) of the ideal step.

    .venv/bin/python bench/pipeline_bubble.py [--steps 6] [--hidden 384] [--layers 4]

On a machine with fewer than 4 free cores the processes also wait for a core, which the
timers count as compute: the figures are then a lower bound of the pure-schedule idle time
only approximately; the simulated plan (slot counts, F = B) is printed too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from nanotron_parallel.testing import run_distributed

PP, M, V = 4, 8, 2


class Chunk(nn.Module):
    def __init__(self, hidden: int, layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x, batch):
        x = batch["x"] if self.first else x
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean() if self.last else x


def rank_main(engine: str, steps: int, hidden: int, layers: int) -> dict:
    import nanotron_parallel.pipeline.interleaved as inter
    import nanotron_parallel.pipeline.p2p as p2p
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.pipeline import run_pipeline_step

    torch.set_num_threads(1)
    waited = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                waited[0] += time.perf_counter() - t0

        return wrapper

    p2p.exchange = timed(p2p.exchange)
    inter.exchange_many = timed(inter.exchange_many)
    pc = ParallelContext(pp=PP)
    v = V if engine == "interleaved-1f1b" else 1
    r = pc.pp_rank
    torch.manual_seed(r)
    chunks = [
        Chunk(hidden, layers // v, c * PP + r == 0, c * PP + r == PP * v - 1) for c in range(v)
    ]
    model: nn.Module = chunks[0]
    if v > 1:
        model = nn.Module()
        model.chunks = chunks
    batches = [{"x": torch.randn(64, hidden)} for _ in range(M)]
    fractions = []
    for step in range(steps + 1):
        torch.distributed.barrier(group=pc.pp_group)
        waited[0] = 0.0
        t0 = time.perf_counter()
        run_pipeline_step(engine, model, batches, pc)
        total = time.perf_counter() - t0
        if step > 0:  # the first step warms up allocators and connections
            fractions.append(waited[0] / total)
    pc.destroy()
    return {"rank": r, "idle": statistics.median(fractions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from nanotron_parallel.pipeline.interleaved import plan_interleaved

    print(f"pp={PP}, m={M}, gloo, 1 thread per process, {args.steps} measured steps")
    print(
        f"{'engine':<18}{'formula':>9}{'plan':>8}"
        + "".join(f"{f'stage {r}':>10}" for r in range(PP))
        + f"{'mean':>8}"
    )
    for engine in ("afab", "1f1b", "interleaved-1f1b"):
        v = V if engine == "interleaved-1f1b" else 1
        formula = (PP - 1) / (v * M + PP - 1)
        plan = plan_interleaved(PP, v, M).idle_fraction(0)  # F = B = 1 slot; 1f1b == v=1
        res = run_distributed(
            rank_main, PP, engine, args.steps, args.hidden, args.layers, timeout=600
        )
        idle = [x["idle"] for x in sorted(res, key=lambda x: x["rank"])]
        cells = "".join(f"{x:>10.3f}" for x in idle)
        print(f"{engine:<18}{formula:>9.3f}{plan:>8.3f}{cells}{statistics.mean(idle):>8.3f}")


if __name__ == "__main__":
    main()
