"""Dashboard load benchmark: sustained ingest, ingest-to-browser latency, metrics API at 1M points.

    .venv/bin/python bench/dashboard_load.py [--trainers 16] [--steps 1500] [--values 10]
                                             [--backends sqlite,postgresql] [--only-backends]

0. SQLite and PostgreSQL side by side (--backends; PostgreSQL is Debian's server started in a
   temporary directory, as the tests do): for each, sustained ingest points/s and the p99 of
   GET metrics polled meanwhile, the same load as 1 and 4 below. --only-backends stops there.

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
  4. p99 of GET /api/runs/{id}/metrics (4 series of 2,000 points) polled while the trainers of
     2 ingest (training-like rate) and while they ingest flat out;
  5. the server's peak RSS (VmHWM) after all of that plus hostile junk (issue 13): 40 metrics
     GETs of 5,000 unknown names, 24 ingest bodies of 1 MiB from 4 parallel posters (the
     writer queue pushes back with 503) and at the same time 16 websocket messages of 1 MiB.
Aims (issue 8): >= 50k points/s, p99 < 100 ms, < 300 ms. Issue 13: metrics GET p99 < 100 ms
on 2 cores, peak RSS under RSS_BUDGET_MIB.
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
import threading
import time
import urllib.error
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


RSS_BUDGET_MIB = 384  # writer queue 64 MiB, websocket buffers, parsing in flight, the server


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """The process's resident set (VmRSS) or its peak so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, method="POST")
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def seed_reader(url: str) -> None:
    """A run with 4 series of 2,000 points: what a run page fetches."""
    _post(url + "/api/ingest", json.dumps({"type": "run_start", "run_id": "reader"}).encode())
    msgs = [
        {
            "type": "metrics",
            "run_id": "reader",
            "step": s,
            "values": {
                "lm_loss": 1.0 / (s + 1),
                "grad_norm": 1.0,
                "lr": 1e-3,
                "tokens_per_sec": 5e3,
            },
        }
        for s in range(2000)
    ]
    for i in range(0, 2000, 1000):
        _post(url + "/api/ingest", json.dumps(msgs[i : i + 1000]).encode())


class Poller:
    """GETs the reader run's metrics in a loop (a run page reloading), timing each."""

    def __init__(self, url: str) -> None:
        self.url = url + "/api/runs/reader/metrics?max_points=2000"
        self.lat: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=60) as r:
                body = json.loads(r.read())
            self.lat.append(time.perf_counter() - t0)
            assert all(len(s["x"]) == 2000 for s in body["series"].values())
            time.sleep(0.05)


def junk(url: str) -> dict[str, int]:
    """Issue 13's memory probes; returns how the server answered them."""
    codes: dict[str, int] = {}
    names = ",".join(f"junk{i}" for i in range(5000))
    for _ in range(40):
        with urllib.request.urlopen(f"{url}/api/runs/reader/metrics?names={names}", timeout=60):
            pass
    msg = [
        {"type": "metrics", "run_id": "junk", "step": s, "values": {f"v{i}": 1.0 for i in range(8)}}
        for s in range(4500)
    ]
    body = json.dumps(msg[: len(msg) * (1 << 20) // (len(json.dumps(msg)) + 1)]).encode()

    def poster() -> None:
        for _ in range(6):
            code = _post(url + "/api/ingest", body)
            codes[str(code)] = codes.get(str(code), 0) + 1

    threads = [threading.Thread(target=poster) for _ in range(4)]
    for t in threads:
        t.start()

    async def flood() -> None:
        from websockets.asyncio.client import connect

        # no keepalive: the server stops reading while its writer pushes back (by design)
        async with connect(
            url.replace("http", "ws", 1) + "/ws/ingest", max_size=None, ping_interval=None
        ) as ws:
            for _ in range(16):
                await ws.send(body.decode())
            await ws.send(json.dumps({"type": "heartbeat", "run_id": "junk", "ack": 9}))
            while json.loads(await ws.recv()).get("ack") != 9:
                pass

    asyncio.run(flood())
    for t in threads:
        t.join()
    return codes


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


def side_by_side(backends: list[str], trainers: int, steps: int, values: int) -> None:
    """Part 0: the same ingest and read load on each backend, one line each."""
    server = None
    try:
        for backend in backends:
            with tempfile.TemporaryDirectory() as tmp:
                if backend == "postgresql":
                    if server is None:
                        from pg_server import start

                        server = start()
                    db: str | Path = server.fresh_database()
                else:
                    db = Path(tmp) / "side.db"
                d = start_dashboard(db)
                try:
                    seed_reader(d.url)
                    with Poller(d.url) as poll:
                        secs, _ = run_load(d.url, trainers, steps, values, None, backend)
                finally:
                    d.stop()
            points = trainers * steps * values
            print(
                f"0. {backend:10s}: ingest {points / secs:,.0f} points/s ({trainers} trainers, "
                f"{points:,} points in {secs:.2f} s); GET metrics (4 x 2,000 points) meanwhile: "
                f"p99 {p99(poll.lat) * 1e3:.0f} ms, median {statistics.median(poll.lat) * 1e3:.0f} "
                f"ms ({len(poll.lat)} GETs)",
                flush=True,
            )
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trainers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--values", type=int, default=10)
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--only-backends", action="store_true", help="part 0 only")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    backends = [b for b in args.backends.split(",") if b]
    side_by_side(backends, args.trainers, args.steps, args.values)
    if args.only_backends:
        return
    with tempfile.TemporaryDirectory() as tmp:
        d = start_dashboard(Path(tmp) / "load.db")
        try:
            idle_rss = rss_mib(d.proc.pid, "VmRSS")
            seed_reader(d.url)
            with Poller(d.url) as full_poll:
                secs, lat_full = run_load(
                    d.url, args.trainers, args.steps, args.values, None, "full"
                )
            points = args.trainers * args.steps * args.values
            print(
                f"1. sustained ingest: {points / secs:,.0f} points/s ({args.trainers} trainers, "
                f"{points:,} points in {secs:.2f} s)   [aim >= 50,000]"
            )
            with Poller(d.url) as paced_poll:
                _, lat = run_load(d.url, args.trainers, 200, args.values, 20.0, "paced")
            print(
                f"2. ingest-to-subscriber latency: p99 {p99(lat) * 1e3:.1f} ms, median "
                f"{statistics.median(lat) * 1e3:.1f} ms at 20 steps/s per trainer ({len(lat)} samples); "
                f"under full load p99 {p99(lat_full) * 1e3:.0f} ms   [aim p99 < 100 ms]"
            )
            print(
                f"4. GET metrics (4 x 2,000 points) while {args.trainers} trainers ingest: p99 "
                f"{p99(paced_poll.lat) * 1e3:.0f} ms, median "
                f"{statistics.median(paced_poll.lat) * 1e3:.0f} ms at 20 steps/s per trainer "
                f"({len(paced_poll.lat)} GETs); flat out p99 {p99(full_poll.lat) * 1e3:.0f} ms "
                f"({len(full_poll.lat)} GETs)   [aim p99 < 100 ms on 2 cores]"
            )
            load_peak = rss_mib(d.proc.pid)
            answers = junk(d.url)
            peak = rss_mib(d.proc.pid)
            print(
                f"5. server peak RSS: {load_peak:.0f} MiB after the load, {peak:.0f} MiB after the "
                f"junk too (idle {idle_rss:.0f} MiB: x{peak / idle_rss:.1f}); junk ingest "
                f"answers {answers}   [budget {RSS_BUDGET_MIB} MiB: "
                f"{'within' if peak <= RSS_BUDGET_MIB else 'OVER'}]"
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
