"""Straggler events of real 4-process runs (dp=2 x pp=2) with the default detector settings:
undisturbed (false alarms), and with rank 3 slowed from outside (named? how soon? anyone else?).

    .venv/bin/python bench/straggler_false_alarms.py [--runs 20] [--slowed 5]
        [--slow-by sigstop|cgroup] [--steps 150] [--interval 5] [--hidden 128]
        [--save series.jsonl] [--replay series.jsonl ...]

Each run is a small Llama (4 layers of `--hidden`, sequences of 64 tokens; 30-150 ms of work
per rank per step on the 2-core development machine, 0.15-0.75 s per interval of 5 steps: the
tests' tiny model gave 4-25 ms, shorter than a scheduler's slice) streaming to an in-process
fake ingest (the dashboard's message model); the events are what the trainer's rank 0 sent.
Nothing disturbs the undisturbed workers but the machine itself: 4 processes on 2 cores with
whatever else runs there (the load average is printed with each run). `--slowed` runs slow
rank 3 (dp=1 pp=1) from outside once `--slow-after` intervals arrived (the detector has a
baseline), and report the interval of the slowdown that named it, and how much slower than its
stage peer it measured (median ratio after onset):
- `sigstop` stops it 40 ms of every 60 (a duty cycle that lands on its compute and on its
  waits; a rank woken from a stop is favoured by the scheduler, so it loses less than 2/3);
- `cgroup` moves its worker into a cgroup-v1 CPU group of its own with half a task's weight
  (`cpu.shares` 512: under contention it gets half of what a process gets) and a quarter
  core's quota (half its fair share of 2 cores among 4 workers when nothing else runs): a
  steady ~2x slower rank, as a throttled device. Needs root and /sys/fs/cgroup/cpu.
`--save` appends each run's rank_stats busy times (compute + optimizer + data, ms per step, per
rank per interval) and events as one JSON line; `--replay` runs no training: the current
detector on saved series, as rank 0 would have run it (to compare detector variants on the
same real runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotron_train.config.schema import LoggingArgs  # noqa: E402
from nanotron_train.telemetry.stragglers import StragglerDetector  # noqa: E402
from tests.train.fault_helpers import kill  # noqa: E402
from tests.train.telemetry_helpers import FakeIngest, Torchrun4, telemetry_config  # noqa: E402

LAYOUT = {"dp": 2, "tp": 1, "pp": 2, "layers": 4}
SLOW_RANK, PEER = 3, 2  # ranks are pp-major: 3 is dp=1 pp=1, 2 (dp=0 pp=1) its stage peer
CGROUP = Path("/sys/fs/cgroup/cpu/nanotron-straggler-bench")


def bench_config(tmp: Path, name: str, args: argparse.Namespace) -> Path:
    path = telemetry_config(tmp, name, LAYOUT, args.steps, rank_stats_interval=args.interval)
    raw = yaml.safe_load(path.read_text())
    h = args.hidden
    raw["model"]["model_config"].update(
        hidden_size=h, intermediate_size=4 * h, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=64,
    )  # fmt: skip
    raw["tokens"].update(sequence_length=64, micro_batch_size=2, batch_accumulation_per_replica=2)
    path.write_text(yaml.safe_dump(raw))
    return path


def wait_for_intervals(run: Torchrun4, ingest: FakeIngest, n: int) -> int:
    """Wait until `n` rank_stats arrived (the detector has a baseline): the last one's step."""
    run.wait_workers()
    while len(got := ingest.of_type("rank_stats")) < n:
        assert run.proc.poll() is None, run.output()[-4000:]
        time.sleep(0.05)
    return got[-1]["step"]


def stopped(run: Torchrun4, pid: int) -> int:
    """Run with `pid` stopped 40 ms of every 60 (SIGSTOP/SIGCONT from a thread)."""
    done = threading.Event()

    def duty_cycle() -> None:
        while not done.is_set():
            kill(pid, signal.SIGSTOP)
            time.sleep(0.04)
            kill(pid, signal.SIGCONT)
            time.sleep(0.02)

    threading.Thread(target=duty_cycle, daemon=True).start()
    try:
        return run.wait(timeout=900)
    finally:
        done.set()


def capped(run: Torchrun4, pid: int) -> int:
    """Run with `pid` (every thread: cgroup.procs) in a CPU group of half a task's weight and a
    quarter core's quota."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "cpu.shares").write_text("512")
    (CGROUP / "cpu.cfs_period_us").write_text("100000")
    (CGROUP / "cpu.cfs_quota_us").write_text("25000")
    (CGROUP / "cgroup.procs").write_text(str(pid))
    try:
        return run.wait(timeout=900)
    finally:
        for task in (CGROUP / "cgroup.procs").read_text().split():  # back to the root group
            (CGROUP.parent / "cgroup.procs").write_text(task)
        CGROUP.rmdir()


def one_run(tmp: Path, name: str, args: argparse.Namespace, slow_by: str | None) -> dict:
    ingest = FakeIngest()
    cfg = bench_config(tmp, name, args)
    start, load = time.monotonic(), os.getloadavg()[0]
    run, onset = Torchrun4(cfg, ingest.url), None
    try:
        if slow_by is None:
            status = run.wait(timeout=900)
        else:
            onset = wait_for_intervals(run, ingest, args.slow_after) + args.interval
            pid = run.workers()[SLOW_RANK]
            status = (stopped if slow_by == "sigstop" else capped)(run, pid)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        ingest.close()
    busy = [
        [
            sum(r.get(k) or 0.0 for k in ("compute_ms", "optimizer_ms", "data_ms"))
            for r in m["ranks"]
        ]
        for m in ingest.of_type("rank_stats")
    ]
    return {
        "name": name, "slow_by": slow_by, "status": status, "load": [load, os.getloadavg()[0]],
        "secs": time.monotonic() - start, "steps": [m["step"] for m in ingest.of_type("rank_stats")],
        "pp": [r["pp"] for r in ingest.of_type("rank_stats")[0]["ranks"]] if busy else [],
        "onset": onset, "busy": busy, "events": ingest.events("straggler"),
        "tail": failure(run.output()) if status else "",
    }  # fmt: skip


def failure(log: str) -> str:
    """A failed run's first error lines (a worker's, not torchrun's summary)."""
    lines = [ln for ln in log.splitlines() if "Error" in ln or "error:" in ln]
    return "\n".join(lines[:5])


def report(i: int, r: dict) -> str:
    ranks = [e["details"].get("rank") for e in r["events"]]
    steps = [e.get("step") for e in r["events"]]
    mean = [sum(col) / len(r["busy"]) for col in zip(*r["busy"])] if r["busy"] else []
    kind = f"slowed ({r['slow_by']})" if r["slow_by"] else "undisturbed"
    return (
        f"{kind} run {i}: exit {r['status']}, straggler events naming ranks {ranks} at steps "
        f"{steps}, mean busy ms per rank {[round(b) for b in mean]}, load "
        f"{r['load'][0]:.1f}->{r['load'][1]:.1f}, {r['secs']:.0f} s"
    )


def replayed(r: dict) -> dict:
    """`r` with the events the current detector (the defaults of logging.straggler_*) raises on
    its recorded series: what rank 0 would have sent, computed as rank 0 computes it."""
    det = StragglerDetector(LoggingArgs.straggler_margin, LoggingArgs.straggler_intervals)
    events = []
    for step, busy in zip(r["steps"], r["busy"]):
        ranks = [
            {"rank": i, "pp": pp, "compute_ms": b} for i, (pp, b) in enumerate(zip(r["pp"], busy))
        ]
        events += [
            {"step": step, "details": {"rank": e["rank"], "ratio": q}}
            for e, q in det.observe(ranks)
        ]
    return {**r, "events": events}


def slowdown(r: dict, interval: int) -> float:
    """How much slower the slowed rank was than its stage peer: the median ratio after onset."""
    j = r["steps"].index(r["onset"]) if r["onset"] in r["steps"] else len(r["steps"])
    ratios = [b[SLOW_RANK] / b[PEER] for b in r["busy"][j:]]
    return statistics.median(ratios) if ratios else math.nan


def tally(results: list[dict], interval: int) -> list[str]:
    healthy = [r for r in results if r["slow_by"] is None and r["status"] == 0]
    alarms = sum(len(r["events"]) for r in healthy)
    lines = [f"undisturbed: {alarms} false alarms in {sum(bool(r['events']) for r in healthy)} "
             f"of {len(healthy)} runs"]  # fmt: skip
    for how in ("sigstop", "cgroup"):
        slowed = [r for r in results if r["slow_by"] == how and r["status"] == 0]
        if not slowed:
            continue
        delays, wrong = [], 0
        for r in slowed:
            named = [
                e
                for e in r["events"]
                if e["details"].get("rank") == SLOW_RANK and e["step"] >= r["onset"]
            ]
            wrong += len(r["events"]) - len(named)
            if named:
                delays.append((named[0]["step"] - r["onset"]) // interval + 1)
        ratios = sorted(round(slowdown(r, interval), 2) for r in slowed)
        lines.append(
            f"slowed by {how} (rank {SLOW_RANK} over its peer after onset, median per run: "
            f"{ratios}): named in {len(delays)} of {len(slowed)} runs, at interval "
            f"{sorted(delays)} of the slowdown; {wrong} events naming another rank or before onset"
        )
    failed = len([r for r in results if r["status"]])
    return lines + ([f"{failed} runs failed (left out)"] if failed else [])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--slowed", type=int, default=0)
    p.add_argument("--slow-by", choices=("sigstop", "cgroup"), default="sigstop")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--interval", type=int, default=5, help="rank_stats_interval (steps)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--slow-after", type=int, default=6, help="intervals before the slowdown")
    p.add_argument("--save", type=Path, help="append each run's series (JSON lines)")
    p.add_argument("--replay", type=Path, nargs="+", help="no runs: the detector on saved series")
    args = p.parse_args()
    if args.replay:
        results = [
            replayed(json.loads(ln)) for f in args.replay for ln in f.read_text().splitlines()
        ]
        print("\n".join(tally(results, args.interval)))
        return
    results = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        plan = [(f"healthy{i}", None) for i in range(args.runs)]
        plan += [(f"slowed{i}", args.slow_by) for i in range(args.slowed)]
        for i, (name, slow_by) in enumerate(plan):
            r = one_run(tmp, name, args, slow_by)
            results.append(r)
            print(report(i, r), flush=True)
            if r["status"]:
                print(r["tail"], flush=True)
            if args.save:
                with args.save.open("a") as f:
                    f.write(json.dumps(r) + "\n")
    setting = f"{args.steps} steps, rank stats every {args.interval}, hidden {args.hidden}"
    print(f"{setting}:\n" + "\n".join(tally(results, args.interval)))


if __name__ == "__main__":
    main()
