"""Exit statuses of finished runs under CPU contention: the trainer's exit vs Python's own.

Each round starts `--parallel` 4-process launches at once (dp1 x tp2 x pp2, async TP, async
checkpoint saves, data prefetch, telemetry, the hang watchdog; a daemon thread in every worker
kept busy in torch matmuls, as a library's thread would be) and counts exit statuses and aborts
("terminate called"). `--exit python` runs the workers' `main()` under plain `sys.exit`, the
exit path before process_exit.py, for the comparison.

    .venv/bin/python bench/exit_stress.py --rounds 4 --parallel 3 --exit trainer
    .venv/bin/python bench/exit_stress.py --rounds 4 --parallel 3 --exit python
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.train.test_clean_exit import SITECUSTOMIZE, _config  # noqa: E402

PYTHON_EXIT = "import sys; from nanotron_train.__main__ import main; sys.exit(main())"


def launch(tmp: Path, name: str, exit_path: str, env: dict) -> subprocess.Popen:
    cfg = _config(tmp, name, "http://127.0.0.1:9")  # no dashboard: the client retries
    if exit_path == "trainer":
        worker = ["-m", "nanotron_train", "--config-file", str(cfg)]
    else:
        worker = ["--no-python", sys.executable, "-c", PYTHON_EXIT, "--config-file", str(cfg)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    return subprocess.Popen(
        [*cmd, *worker], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--parallel", type=int, default=3)
    p.add_argument("--exit", choices=("trainer", "python"), default="trainer")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="exit-stress-"))
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp / "site")}
    statuses: Counter = Counter()
    aborts = 0
    for r in range(args.rounds):
        procs = [launch(tmp, f"r{r}-{i}", args.exit, env) for i in range(args.parallel)]
        for proc in procs:
            out = proc.communicate(timeout=600)[0]
            statuses[proc.returncode] += 1
            aborts += "terminate called" in out
    runs = args.rounds * args.parallel
    print(f"exit={args.exit}: {runs} launches, exit statuses {dict(statuses)}, {aborts} aborted")


if __name__ == "__main__":
    main()
