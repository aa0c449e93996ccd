"""Wall time of each phase of a training step, ours or picotron's, from the outside.

Runs a training command in this process (`-m MODULE` or a script path, with its arguments)
after wrapping the functions each phase calls, so both frameworks are timed the same way and
neither is changed: for each step after the warm-up it sums the wall time spent in each phase
(data, zero_grad, forward, loss, backward, reduction wait, norm, clip, optimizer, loss read,
record/logging, telemetry, checkpoint hook), and the step's whole wall time (from one step's
start to the next one's); "other" is what no phase covers. Rank 0 prints the medians in ms and
their spread (min-max). `--ops N` adds torch.profiler's table of the N ops with the most self
CPU time over the timed steps. Needs only torch (it runs in picotron's environment too); under
`torchrun` every rank times itself and rank 0 prints.

    # ours, one process (the peers bench's model: see bench/peers.py)
    .venv/bin/python bench/step_profile.py --fw ours --warmup 3 -- -m nanotron_train \
        --config-file configs/tiny-llama-cpu.yaml --override ...
    # picotron, dp=2, in its environment
    /tmp/peer-pico/bin/python -m torch.distributed.run --nproc_per_node=2 bench/step_profile.py \
        --fw pico -- /tmp/peer-pico/src/train.py --config config.json
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import os
import runpy
import statistics
import sys
import time

# phase -> "module:qualified.name" of the function whose calls it are; a call made inside
# another phase's call counts for the outer one only (torch's AdamW reads `.item()` too).
PHASES = {
    "ours": {
        "zero_grad": "nanotron_parallel.data_parallel.buckets:DataParallelGrads.zero_grad",
        "forward": "nanotron_parallel.pipeline.schedules:_StageRun.forward",
        "backward": "nanotron_parallel.pipeline.schedules:_StageRun.backward",
        "dp_wait": "nanotron_parallel.data_parallel.buckets:DataParallelGrads.finish",
        "norm": "nanotron_train.trainer:global_grad_norm",
        "clip": "nanotron_train.trainer:clip_grads",
        "optimizer": "nanotron_train.optim:AdamWOnPieces.step",
        "loss_read": "nanotron_train.step_record:StepRecorder.global_mean_loss",
        "record+log": "nanotron_train.trainer:Trainer._record_if_due",
        "telemetry": "nanotron_train.telemetry.session:Telemetry.after_step",
        "checkpoint_hook": "nanotron_train.trainer:Trainer._save_if_due",
    },
    "pico": {
        "data": "picotron.data:MicroBatchDataLoader.__next__",
        "zero_grad": "torch.optim.optimizer:Optimizer.zero_grad",
        "forward": "picotron.model:Llama.forward",
        "loss": "torch.nn.functional:cross_entropy",
        "backward": "torch:Tensor.backward",
        "loss_read": "torch:Tensor.item",
        "loss_avg": "picotron.utils:average_loss_across_dp_cp_ranks",
        "optimizer": "torch.optim.adamw:AdamW.step",
    },
}
# The call that starts a step.
STEP_START = {"ours": "nanotron_train.trainer:Trainer.train_step", "pico": "zero_grad"}


def now() -> tuple[float, float]:
    """(wall, this process's CPU time): the CPU time shows the work itself on a loaded machine."""
    return time.perf_counter(), time.process_time()


class Clock:
    def __init__(self, warmup: int, ops: int, shapes: bool = False) -> None:
        self.warmup, self.ops, self.shapes = warmup, ops, shapes
        self.steps: list[dict[str, list[float]]] = []  # per step: phase -> [wall s, cpu s]
        self.step_start: tuple[float, float] | None = None
        self.active: str | None = None  # the outermost phase running now
        self.prof = None

    def add(self, phase: str, t0: tuple[float, float]) -> None:
        t1 = now()
        cur = self.steps[-1].setdefault(phase, [0.0, 0.0])
        cur[0] += t1[0] - t0[0]
        cur[1] += t1[1] - t0[1]

    def new_step(self) -> None:
        if self.step_start is not None and self.steps:
            self.add("step", self.step_start)
        if self.ops and len(self.steps) == self.warmup and self.prof is None:
            import torch.profiler

            self.prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=self.shapes
            )
            self.prof.__enter__()
        self.steps.append({})
        self.step_start = now()

    def wrap(self, phase: str | None, fn, starts_step: bool = False):
        """`fn`, its calls' time added to `phase` (None: not timed, only a step start)."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if starts_step:
                self.new_step()
            if phase is None or self.active is not None or not self.steps:
                return fn(*args, **kwargs)  # not timed, nested, or before the first step
            self.active, t0 = phase, now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = None
                self.add(phase, t0)

        return timed

    def report(self, phases: list[str]) -> str:
        timed = [s for s in self.steps[self.warmup :] if "step" in s]
        if not timed:
            return "no timed step (fewer steps than --warmup + 2?)"
        rows = [f"{'phase':<16} {'wall ms':>8} {'min-max':>15} {'% step':>7} {'cpu ms':>8}"]
        for s in timed:  # what no phase covers
            s["other"] = [s["step"][i] - sum(s.get(p, (0, 0))[i] for p in phases) for i in (0, 1)]
        step_ms = statistics.median(s["step"][0] for s in timed) * 1e3
        for p in [*phases, "other", "step"]:
            wall = [s.get(p, (0, 0))[0] * 1e3 for s in timed]
            cpu = statistics.median(s.get(p, (0, 0))[1] * 1e3 for s in timed)
            med = statistics.median(wall)
            rows.append(
                f"{p:<16} {med:8.1f} {min(wall):7.1f}-{max(wall):7.1f} "
                f"{100 * med / step_ms:7.1f} {cpu:8.1f}"
            )
        rows.append(f"timed steps: {len(timed)} (medians over them)")
        return "\n".join(rows)


def resolve(spec: str):
    mod_name, qual = spec.split(":")
    owner = importlib.import_module(mod_name)
    *path, attr = qual.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def install(clock: Clock, fw: str) -> list[str]:
    phases = PHASES[fw]
    start = STEP_START[fw]
    if start not in phases:  # a step-start call that is not a phase of its own
        owner, attr = resolve(start)
        setattr(owner, attr, clock.wrap(None, getattr(owner, attr), starts_step=True))
    for phase, spec in phases.items():
        owner, attr = resolve(spec)
        setattr(owner, attr, clock.wrap(phase, getattr(owner, attr), starts_step=phase == start))
    return list(phases)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fw", choices=sorted(PHASES), required=True)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--ops", type=int, default=0, help="print torch.profiler's top N ops")
    ap.add_argument("--shapes", action="store_true", help="--ops: one row per op and shapes")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- -m MODULE ARGS | SCRIPT ARGS")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.fw == "pico":  # picotron imports its package from the script's folder
        sys.path.insert(0, os.path.dirname(os.path.abspath(cmd[0])))
    clock = Clock(args.warmup, args.ops, args.shapes)
    phases = install(clock, args.fw)  # before the script imports the names it calls
    # nanotron_train leaves through os._exit after running the atexit functions
    atexit.register(functools.partial(print_report, clock, args, phases))
    try:
        if cmd[0] == "-m":
            sys.argv = [cmd[1], *cmd[2:]]
            runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(cmd)
            runpy.run_path(cmd[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise


def print_report(clock: Clock, args, phases: list[str]) -> None:
    """The last step (no next start: it would include the teardown) is not timed."""
    if clock.prof is not None:
        clock.prof.__exit__(None, None, None)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(f"\n== step phases ({args.fw}, world {os.environ.get('WORLD_SIZE', '1')}) ==")
    print(clock.report(phases))
    if clock.prof is not None:
        table = clock.prof.key_averages(group_by_input_shape=args.shapes)
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.ops,
                          max_name_column_width=40, max_shapes_column_width=70))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
