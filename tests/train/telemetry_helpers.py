"""A fake dashboard ingest (a websocket server that records every message) and a 4-process
torchrun launcher, for the telemetry tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from tests.train.fault_helpers import ROOT, alive, children, env_of, kill
from tests.train.test_checkpoint import tiny_config


class FakeIngest:
    """Answers the trainer's handshake like the dashboard and keeps every message."""

    def __init__(self) -> None:
        from websockets.sync.server import serve

        self.messages: list[dict] = []
        self._lock = threading.Lock()
        self._server = serve(self._handle, "127.0.0.1", 0, max_size=2**24)
        self.port = self._server.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _handle(self, ws) -> None:
        for raw in ws:
            msg = json.loads(raw)
            with self._lock:
                self.messages.append(msg)
            if msg.get("type") == "run_start":
                ws.send(json.dumps({"type": "run_start", "ok": True, "last_step": None}))
            elif msg.get("ack"):
                ws.send(json.dumps({"type": "ack", "ok": True}))

    def of_type(self, kind: str) -> list[dict]:
        with self._lock:
            return [m for m in self.messages if m.get("type") == kind]

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in self.of_type("event") if kind is None or e["kind"] == kind]

    def refused(self) -> list[tuple[dict, str]]:
        """The messages the real dashboard's validator refuses, with its reason (the contract
        between the two sides, checked with the dashboard's own code)."""
        from nanotron_dashboard.messages import MessageError, parse_messages

        with self._lock:
            sent = list(self.messages)
        out = []
        for msg in sent:
            (result,) = parse_messages(json.dumps(msg))
            if isinstance(result, MessageError):
                out.append((msg, str(result)))
        return out

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)


def telemetry_config(
    tmp: Path, name: str, layout: dict, steps: int, tokens: dict | None = None, **logging
) -> Path:
    """The checkpoint tests' tiny Llama in `layout`, metrics to `<tmp>/<name>.jsonl`."""
    raw = tiny_config(layout, str(tmp / f"{name}-ck"), steps=steps)
    raw["checkpoints"]["checkpoints_path"] = None
    raw["tokens"].update(tokens or {})
    raw["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = steps
    raw["logging"].update(metrics_file=str(tmp / f"{name}.jsonl"), **logging)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Torchrun4:
    """`torchrun --standalone --nproc_per_node=4 -m nanotron_train ...`, streaming to `url`."""

    def __init__(self, cfg: Path, url: str, nproc: int = 4) -> None:
        self.log = cfg.with_suffix(".log")
        self.nproc = nproc
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env["NANOTRON_DASHBOARD_URL"] = url
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "--monitor-interval=0.2",
            "-m", "nanotron_train", "--config-file", str(cfg),
        ]  # fmt: skip
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out)

    def output(self) -> str:
        return self.log.read_text()

    def workers(self) -> dict[int, int]:
        out = {}
        for pid in children(self.proc.pid):
            rank = env_of(pid).get("RANK")
            if rank is not None and alive(pid):
                out[int(rank)] = pid
        return out

    def wait_workers(self, timeout: float = 120) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while len(found := self.workers()) < self.nproc:
            assert self.proc.poll() is None, self.output()[-4000:]
            assert time.monotonic() < deadline, "the workers never came up"
            time.sleep(0.05)
        return found

    def wait_with_a_slowed_rank(
        self, rank: int, stop_s: float = 0.04, run_s: float = 0.02, after: Path | None = None
    ) -> int:
        """Stop `rank`'s worker `stop_s` of every `stop_s + run_s` (from outside: by default it
        works at a third of its speed), from when the file `after` has something in it (e.g.
        the metrics file: the first step is done; a slowed start-up only makes a test longer)
        until the run ends; the exit status."""
        workers = self.wait_workers()
        done = threading.Event()

        def slow_down() -> None:
            while after is not None and not done.is_set():
                if after.exists() and after.stat().st_size > 0:
                    break
                time.sleep(0.02)
            while not done.is_set():
                kill(workers[rank], signal.SIGSTOP)
                time.sleep(stop_s)
                kill(workers[rank], signal.SIGCONT)
                time.sleep(run_s)

        threading.Thread(target=slow_down, daemon=True).start()
        try:
            return self.wait()
        finally:
            done.set()
            if self.proc.poll() is None:
                self.proc.kill()

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"torchrun did not finish:\n{self.output()[-4000:]}") from None
