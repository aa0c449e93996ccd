"""Straggler events of real, undisturbed 4-process runs (dp=2 x pp=2) with the default
detector settings, and of the same run with one worker slowed from outside.

    .venv/bin/python bench/straggler_false_alarms.py [--runs 20] [--steps 60] [--slowed 2]
        [--slow-by sigstop|cgroup]

Each run is the checkpoint tests' tiny Llama, streaming to an in-process fake ingest (the
dashboard's message model), rank stats every 2 steps; nothing disturbs the workers but the
machine itself (on the 2-core development machine, 4 processes share 2 cores: the noise the
detector must tolerate). `--slowed` more runs slow rank 3 from outside and report the step of
the first event naming it: `sigstop` stops it 40 ms of every 60 (a duty cycle that lands on its
compute in some intervals and on its waits in others), `cgroup` caps its CPU with a cgroup-v1
CPU quota of a quarter core (half its share of the 2 cores: a steady 2x slower rank, as a
throttled device; needs root and /sys/fs/cgroup/cpu). bench/
dashboard_false_alarms.py models the same detector on simulated timings; this one counts
what real runs raise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.train.telemetry_helpers import FakeIngest, Torchrun4, telemetry_config  # noqa: E402

LAYOUT = {"dp": 2, "tp": 1, "pp": 2}
INTERVAL = 2
SLOW_RANK = 3


CGROUP = Path("/sys/fs/cgroup/cpu/nanotron-straggler-bench")


def capped(run: Torchrun4) -> int:
    """Run with rank 3's worker in a cgroup of a quarter core (every thread: cgroup.procs)."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "cpu.cfs_period_us").write_text("100000")
    (CGROUP / "cpu.cfs_quota_us").write_text("25000")
    (CGROUP / "cgroup.procs").write_text(str(run.wait_workers()[SLOW_RANK]))
    try:
        return run.wait(timeout=600)
    finally:
        for pid in (CGROUP / "cgroup.procs").read_text().split():  # back to the root group
            (CGROUP.parent / "cgroup.procs").write_text(pid)
        CGROUP.rmdir()


def one_run(tmp: Path, name: str, steps: int, slow_by: str | None) -> tuple[int, list, float]:
    ingest = FakeIngest()
    cfg = telemetry_config(tmp, name, LAYOUT, steps, rank_stats_interval=INTERVAL)
    start = time.monotonic()
    run = Torchrun4(cfg, ingest.url)
    try:
        if slow_by == "sigstop":
            status = run.wait_with_a_slowed_rank(SLOW_RANK)
        elif slow_by == "cgroup":
            status = capped(run)
        else:
            status = run.wait(timeout=600)
    finally:
        ingest.close()
    return status, ingest.events("straggler"), time.monotonic() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--slowed", type=int, default=2)
    p.add_argument("--slow-by", choices=("sigstop", "cgroup"), default="sigstop")
    args = p.parse_args()
    false_alarms = runs_with_alarm = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i in range(args.runs):
            status, events, secs = one_run(tmp, f"healthy{i}", args.steps, None)
            false_alarms += len(events)
            runs_with_alarm += bool(events)
            ranks = [e["details"].get("rank") for e in events]
            print(
                f"healthy run {i}: exit {status}, {len(events)} straggler events {ranks}, {secs:.0f} s",
                flush=True,
            )
        for i in range(args.slowed):
            status, events, secs = one_run(tmp, f"slowed{i}", args.steps, args.slow_by)
            named = [e for e in events if e["details"].get("rank") == SLOW_RANK]
            first = named[0].get("step") if named else None
            others = len(events) - len(named)
            print(f"slowed run {i}: exit {status}, rank {SLOW_RANK} first named at step {first}, "
                  f"{others} events naming another rank, {secs:.0f} s", flush=True)  # fmt: skip
    print(f"undisturbed: {false_alarms} false alarms in {runs_with_alarm} of {args.runs} runs "
          f"({args.steps} steps, rank stats every {INTERVAL})")  # fmt: skip


if __name__ == "__main__":
    main()
