"""Dashboard load benchmark: sustained ingest, ingest-to-browser latency, metrics API at 1M points.

    .venv/bin/python bench/dashboard_load.py [--trainers 16] [--steps 1500] [--values 10]

Starts a real dashboard (uvicorn, a child process) on a temporary database and prints:
  1. sustained ingest in points/s: N simulated trainers (websocket clients spread over a few
     processes), each sending `steps` metrics messages of `values` values as fast as the server
     takes them; timed from the first send to the moment every trainer's last message is
     committed (an `ack` round trip);
  2. p99 ingest-to-subscriber latency: a browser-like subscriber on /ws/runs/{id} while the same
     trainers send at a training-like rate (20 steps/s each), and also under the full load of 1;
  3. the run page's metrics API response time with 1M stored points (4 metrics x 250k steps),
     cold (first read after a restart, from SQLite) and warm (median of 5). The points are
     inserted straight into the database, not through the writer, so the dashboard's start
     seals them into blocks first (once; the writer does it as it ingests): timed too.
Aims (issue 8): >= 50k points/s, p99 < 100 ms, < 300 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dashboard"))
from dashboard_helpers import start_dashboard  # noqa: E402


async def _trainer(url: str, run_id: str, steps: int, values: int, rate: float | None) -> None:
    from websockets.asyncio.client import connect

    async with connect(
        url.replace("http", "ws", 1) + "/ws/ingest", compression=None, max_queue=None
    ) as ws:
        await ws.send(
            json.dumps({"type": "run_start", "run_id": run_id, "project": "bench", "ack": 1})
        )
        await ws.recv()
        names = [f"m{i}" for i in range(values)]
        for step in range(steps):
            msg = {
                "type": "metrics",
                "run_id": run_id,
                "step": step,
                "time": time.time(),
                "values": {n: step * 0.001 + i for i, n in enumerate(names)},
            }
            await ws.send(json.dumps(msg))
            if rate:
                await asyncio.sleep(1.0 / rate)
            elif step % 50 == 0:
                await asyncio.sleep(0)
        await ws.send(json.dumps({"type": "heartbeat", "run_id": run_id, "ack": 2}))
        while json.loads(await ws.recv()).get("ack") != 2:
            pass


def _proc(
    url: str, ids: list[str], steps: int, values: int, rate: float | None, start_at: float
) -> None:
    async def main() -> None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        await asyncio.gather(*(_trainer(url, r, steps, values, rate) for r in ids))

    asyncio.run(main())


async def _subscribe(url: str, run_id: str, lat: list[float], stop: asyncio.Event) -> None:
    from websockets.asyncio.client import connect

    async with connect(url.replace("http", "ws", 1) + f"/ws/runs/{run_id}", max_queue=None) as ws:
        while not stop.is_set():
            try:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 0.5))
            except asyncio.TimeoutError:
                continue
            now = time.time()
            if msg["type"] == "points":
                for step, _value, t in next(iter(msg["points"].values())):
                    lat.append(now - t)
                    del step


def run_load(
    url: str, trainers: int, steps: int, values: int, rate: float | None, tag: str
) -> tuple[float, list[float]]:
    """Trainers in up to 4 processes; a subscriber in this one. Returns (seconds, latencies)."""
    nproc = min(4, trainers)
    ids = [f"{tag}-{i}" for i in range(trainers)]
    start_at = time.time() + 3.0  # every process connected and ready before the clock starts
    procs = [
        mp.get_context("spawn").Process(
            target=_proc, args=(url, ids[k::nproc], steps, values, rate, start_at)
        )
        for k in range(nproc)
    ]
    for p in procs:
        p.start()
    lat: list[float] = []

    async def watch() -> float:
        stop = asyncio.Event()
        sub = asyncio.ensure_future(_subscribe(url, ids[0], lat, stop))
        while any(p.is_alive() for p in procs):
            await asyncio.sleep(0.05)
        end = time.time()
        stop.set()
        await sub
        return end

    end = asyncio.run(watch())
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a trainer process failed (exit {p.exitcode})")
    return end - start_at, lat


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def fill_million(db: Path) -> None:
    """1M points (4 metrics x 250k steps) written straight into a fresh dashboard database."""
    from nanotron_dashboard.db import open_database

    open_database(db).dispose()  # creates the schema
    c = sqlite3.connect(db)
    now = time.time()
    c.execute(
        "INSERT INTO runs(id, project, name, status, config, topology, command, started, updated, heartbeat, step) "
        "VALUES ('big', 'bench', 'big', 'running', '{}', '{}', '[]', ?, ?, ?, 249999)",
        (now - 1e5, now, now),
    )
    names = ["lm_loss", "grad_norm", "lr", "tokens_per_sec"]
    for name in names:
        c.executemany(
            "INSERT INTO metrics(run_pk, name, step, value, time) VALUES (1, ?, ?, ?, ?)",
            (
                (name, s, 1.0 / (s + 1) + (s % 97) * 1e-4, now - 1e5 + s * 0.4)
                for s in range(250_000)
            ),
        )
        c.execute("INSERT INTO latest VALUES (1, ?, 249999, 1.0)", (name,))
    c.commit()
    c.close()


def time_get(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        body = json.loads(r.read())
    assert len(body["series"]) == 4 and all(s["count"] == 250_000 for s in body["series"].values())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trainers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--values", type=int, default=10)
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        d = start_dashboard(Path(tmp) / "load.db")
        try:
            secs, lat_full = run_load(d.url, args.trainers, args.steps, args.values, None, "full")
            points = args.trainers * args.steps * args.values
            print(
                f"1. sustained ingest: {points / secs:,.0f} points/s ({args.trainers} trainers, "
                f"{points:,} points in {secs:.2f} s)   [aim >= 50,000]"
            )
            _, lat = run_load(d.url, args.trainers, 200, args.values, 20.0, "paced")
            print(
                f"2. ingest-to-subscriber latency: p99 {p99(lat) * 1e3:.1f} ms, median "
                f"{statistics.median(lat) * 1e3:.1f} ms at 20 steps/s per trainer ({len(lat)} samples); "
                f"under full load p99 {p99(lat_full) * 1e3:.0f} ms   [aim p99 < 100 ms]"
            )
        finally:
            d.stop()
        db = Path(tmp) / "million.db"
        fill_million(db)
        t0 = time.perf_counter()
        d = start_dashboard(db)
        start_s = time.perf_counter() - t0
        d.stop()  # the cold read below is the first read of a fresh process, as after a restart
        d = start_dashboard(db)
        try:
            url = d.url + "/api/runs/big/metrics?max_points=2000"
            cold = time_get(url)
            warm = statistics.median(time_get(url) for _ in range(5))
            smooth = statistics.median(time_get(url + "&smoothing=0.9") for _ in range(3))
            print(
                f"3. metrics API at 1M stored points (4 series x 250k, 2000 points each): warm "
                f"{warm * 1e3:.0f} ms (median of 5), with smoothing {smooth * 1e3:.0f} ms, cold first "
                f"read {cold * 1e3:.0f} ms   [aim < 300 ms]; first start (sealing 1M rows "
                f"written without the writer) {start_s:.1f} s"
            )
        finally:
            d.stop()


if __name__ == "__main__":
    main()
