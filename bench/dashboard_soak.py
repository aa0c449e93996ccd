"""Dashboard soak: create, fill, read and delete runs in a loop; the server's RSS per cycle.

    .venv/bin/python bench/dashboard_soak.py [--minutes 3] [--runs 40] [--metrics 25] [--steps 400]

Starts a real dashboard (uvicorn, a child process) on a temporary database. Each cycle posts
`runs` new runs (new ids and new metric names every cycle: nothing is reused) of `metrics`
series of `steps` points, each with a checkpoint folder on disk; reads every series through
the metrics API (filling the series cache), lists the checkpoints (the metadata cache), then
deletes every run. After each cycle it prints the server's RSS (/proc) and its memory account
(GET /api/memory). Aim: RSS flat within 10% after the first cycle, peak under the budget, and
the per-run and per-metric structures empty after the deletes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dashboard"))
from dashboard_helpers import start_dashboard  # noqa: E402


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def call(url: str, method: str = "GET", body: object = None, csrf: str | None = None) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    if csrf:
        req.add_header("X-CSRF-Token", csrf)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def fill(url: str, run_id: str, cycle: int, args: argparse.Namespace, ck_root: Path) -> None:
    ck = ck_root / run_id
    (ck / "5").mkdir(parents=True)
    (ck / "5" / "checkpoint_metadata.json").write_text(json.dumps({"step": 5, "files": []}))
    start = {"type": "run_start", "run_id": run_id, "checkpoints_path": str(ck)}
    call(url + "/api/ingest", "POST", start)
    names = [f"c{cycle}_metric_{j}" for j in range(args.metrics)]
    msgs = [
        {"type": "metrics", "run_id": run_id, "step": s, "values": {n: s * 0.5 for n in names}}
        for s in range(args.steps)
    ]
    per_post = 1000
    for i in range(0, len(msgs), per_post):
        call(url + "/api/ingest", "POST", msgs[i : i + per_post])


def cycle_once(url: str, cycle: int, args: argparse.Namespace, ck_root: Path, csrf: str) -> None:
    ids = [f"c{cycle}-r{i}" for i in range(args.runs)]
    for run_id in ids:
        fill(url, run_id, cycle, args, ck_root)
    for run_id in ids:
        call(f"{url}/api/runs/{run_id}/metrics?max_points=500")
        call(f"{url}/api/runs/{run_id}/checkpoints")
    for run_id in ids:
        call(f"{url}/api/runs/{run_id}", "DELETE", csrf=csrf)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--metrics", type=int, default=25)
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = start_dashboard(Path(tmp) / "soak.db")
        try:
            url = d.url
            csrf = call(url + "/api/session")["csrf"]
            idle = rss_mib(d.proc.pid)
            print(
                f"idle RSS {idle:.0f} MiB; {args.runs} runs x {args.metrics} metrics x "
                f"{args.steps} steps per cycle, all deleted at its end"
            )
            print("cycle  seconds  RSS MiB  accounted MiB  series  runs  names  bounds  runs in db")
            curve: list[float] = []
            t0 = time.monotonic()
            cycle = 0
            while time.monotonic() - t0 < args.minutes * 60 or cycle < 2:
                c0 = time.monotonic()
                cycle_once(url, cycle, args, Path(tmp) / "ck", csrf)
                mem = call(url + "/api/memory")
                rss = rss_mib(d.proc.pid)
                curve.append(rss)
                held = mem["held"]
                print(
                    f"{cycle:5d}  {time.monotonic() - c0:7.1f}  {rss:7.0f}  "
                    f"{sum(mem['bytes'].values()) / 2**20:13.1f}  {held['series']:6d}  "
                    f"{held['runs']:4d}  {held['names']:5d}  {held['series_bounds']:6d}  "
                    f"{len(call(url + '/api/runs')):10d}",
                    flush=True,
                )
                cycle += 1
            ref = curve[0]
            worst = max(curve[1:])
            peak = rss_mib(d.proc.pid, "VmHWM")
            print(
                f"after cycle 0: RSS {ref:.0f} MiB; later cycles {min(curve[1:]):.0f}-{worst:.0f} "
                f"MiB (max {100 * (worst / ref - 1):+.1f}%, aim within +10%); peak {peak:.0f} MiB "
                f"(budget {mem['budget_bytes'] >> 20} MiB)"
            )
        finally:
            d.stop()


if __name__ == "__main__":
    main()
