"""Real torchrun launches for the fault-tolerance tests: start, find workers, read metrics."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.train.test_checkpoint import tiny_config

ROOT = Path(__file__).resolve().parents[2]
TP2 = {"dp": 1, "tp": 2, "pp": 1}


def write_config(tmp: Path, name: str, steps: int, interval: int = 5, **sections) -> Path:
    """The checkpoint tests' tiny Llama under tp=2, metrics to `<tmp>/<name>.jsonl`."""
    raw = tiny_config(TP2, str(tmp / f"{name}-ck"), steps=steps)
    raw["checkpoints"]["checkpoint_interval"] = interval
    raw["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = steps
    raw["logging"]["metrics_file"] = str(tmp / f"{name}.jsonl")
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Torchrun:
    """`torchrun --standalone --nproc_per_node=2 -m nanotron_train ...`, output to a file.
    `launcher=True`: `python -m nanotron_train.launch` with the same arguments, in a session of
    its own (its process group is what a batch scheduler signals)."""

    def __init__(
        self,
        cfg: Path,
        *args: str,
        restarts: int = 0,
        env: dict | None = None,
        launcher: bool = False,
    ) -> None:
        self.log = cfg.with_suffix(f".{time.monotonic_ns()}.log")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        head = ["nanotron_train.launch"] if launcher else ["torch.distributed.run"]
        cmd = [
            sys.executable, "-m", *head, "--standalone", "--nproc_per_node=2",
            f"--max-restarts={restarts}", "--monitor-interval=0.2",
            *([] if launcher else ["-m", "nanotron_train"]), "--config-file", str(cfg), *args,
        ]  # fmt: skip
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=launcher
            )

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"torchrun did not finish:\n{self.output()[-4000:]}") from None

    def workers(self) -> dict[int, int]:
        """{rank: pid} of the live workers (children of torchrun)."""
        out = {}
        for pid in children(self.proc.pid):
            rank = env_of(pid).get("RANK")
            if rank is not None and alive(pid):
                out[int(rank)] = pid
        return out

    def wait_workers(self, exclude: set[int] = frozenset(), timeout: float = 120) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while True:
            found = {r: p for r, p in self.workers().items() if p not in exclude}
            if len(found) == 2:
                return found
            assert self.proc.poll() is None, self.output()[-4000:]
            assert time.monotonic() < deadline, "the workers never came up"
            time.sleep(0.05)

    def kill_all(self) -> None:
        for pid in self.workers().values():
            kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def alive(pid: int) -> bool:
    """Running (a zombie, already dead, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def records(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    lines = metrics.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_step(metrics: Path, step: int, run: Torchrun, after: int = 0, timeout=180) -> int:
    """Wait until a record with step >= `step` appears among the records after the first
    `after`; returns how many records there are then."""
    deadline = time.monotonic() + timeout
    while True:
        recs = records(metrics)
        if any(r["step"] >= step for r in recs[after:]):
            return len(recs)
        assert run.proc.poll() is None, run.output()[-4000:]
        assert time.monotonic() < deadline, f"step {step} never came"
        time.sleep(0.02)


def losses_by_step(metrics: Path) -> dict[int, list[float]]:
    """Every lm_loss logged for each step, in order (a restart logs some steps again)."""
    out: dict[int, list[float]] = {}
    for rec in records(metrics):
        out.setdefault(rec["step"], []).append(rec["lm_loss"])
    return out
