"""examples/slurm/train.sbatch: its directives and its srun + launcher line, parsed; then the
script itself run on one "node" with 2 CPU processes (stand-ins for srun and scontrol), from
the wheels' venv. Data parallel 2 must give the one-process losses."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from tests.packaging.packaging_helpers import (
    ROOT,
    STEPS,
    TINY_CONFIG,
    read_metrics,
    tiny_overrides,
)

SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
REL = 1e-5

# On one node, srun runs its command once, here: drop srun's own options, run the rest.
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
exec "$@"
"""
# `scontrol show hostnames NODELIST` prints one host per line; our one node is this machine.
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] || { echo "unexpected: scontrol $*" >&2; exit 1; }
echo localhost
"""


def directives(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").strip().partition("=")
            out[key] = value
    return out


def launch_line(text: str) -> list[str]:
    """The srun command, continuation lines joined, as shell words (variables unexpanded)."""
    joined = text.replace("\\\n", " ")
    (line,) = [ln for ln in joined.splitlines() if ln.strip().startswith("srun ")]
    return shlex.split(line)


def option(words: list[str], name: str) -> str:
    (value,) = [w.split("=", 1)[1] for w in words if w.startswith(name + "=")]
    return value


def test_sbatch_asks_one_torchrun_per_node_joined_by_a_c10d_rendezvous():
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    d = directives(text)
    assert int(d["--nodes"]) >= 2
    assert d["--ntasks-per-node"] == "1"  # torchrun starts the per-GPU processes itself
    words = launch_line(text)
    start = words.index("python")  # the launcher: torchrun with one-line user errors
    srun, launcher = words[:start], words[start:]
    assert launcher[:3] == ["python", "-m", "nanotron_train.launch"], launcher
    assert srun[0] == "srun" and all(w.startswith("--") and "=" in w for w in srun[1:]), srun
    assert option(launcher, "--nnodes") == "$SLURM_NNODES"
    assert option(launcher, "--rdzv_backend") == "c10d"
    assert option(launcher, "--rdzv_endpoint") == "$RDZV_HOST:$RDZV_PORT"
    assert option(launcher, "--rdzv_id") == "$SLURM_JOB_ID"
    assert option(launcher, "--nproc_per_node") == "$NPROC_PER_NODE"
    # The default process count per node is the number of GPUs asked per node.
    assert f"NPROC_PER_NODE=${{NPROC_PER_NODE:-{d['--gpus-per-node']}}}" in text
    m = launcher.index("--config-file")
    assert launcher[m:] == [
        "--config-file", "$CONFIG",
        "--override", "parallelism.dp=$DP", "--override", "parallelism.tp=$TP",
        "--override", "parallelism.pp=$PP",
        "$@",  # extra arguments (--override ...) reach the trainer, after ours: they win
    ]  # fmt: skip
    assert (ROOT / text.split("CONFIG=${CONFIG:-", 1)[1].split("}", 1)[0]).is_file()


def test_sbatch_header_names_what_a_first_multi_node_run_needs():
    """Shared files, the environment, NCCL's network, the dashboard's URL: each named."""
    text = SBATCH.read_text()
    header = text.split("#SBATCH", 1)[0]
    for needed in (
        "checkpoints.checkpoints_path_is_shared_file_system",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "NANOTRON_DASHBOARD_URL",
        "NANOTRON_DASHBOARD_TOKEN",
        "--host 0.0.0.0",
        "synthetic",
    ):
        assert needed in header, needed
    assert 'source "$VENV/bin/activate"' in text
    # The examples in the header must not override what the script sets (the layout).
    examples = [ln for ln in header.splitlines() if "sbatch " in ln and "--override" in ln]
    assert examples and not [ln for ln in examples if "parallelism." in ln], examples


def one_node_env(base: dict[str, str], tmp_path: Path, nproc: int) -> dict[str, str]:
    """What SLURM would set on a one-node allocation, with srun and scontrol stood in for."""
    bin_dir = tmp_path / "fake-slurm"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        **base,
        "PATH": f"{bin_dir}:{base['PATH']}",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "NPROC_PER_NODE": str(nproc),
        "RDZV_PORT": str(port),
        "CONFIG": str(TINY_CONFIG),
        "VENV": str(tmp_path / "no-venv"),  # the caller's environment is the one to use
    }


def run_sbatch(env: dict[str, str], args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SBATCH), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_sbatch_refuses_a_layout_that_does_not_fill_the_allocation(tmp_path: Path):
    env = one_node_env(dict(os.environ), tmp_path, nproc=2)
    proc = run_sbatch({**env, "TP": "4"}, [], tmp_path)
    assert proc.returncode == 2
    assert "2 processes (1 nodes x 2) are not a multiple of TP x PP = 4 x 1" in proc.stderr


@pytest.mark.slow
def test_sbatch_runs_on_one_node_with_2_cpu_processes(
    train_venv, tiny_losses_one_process, tmp_path: Path
):
    env = one_node_env(train_venv.env(), tmp_path, nproc=2)
    metrics = tmp_path / "metrics.jsonl"
    # The script makes it data parallel 2; keep the one-process run's global batch:
    # 2 replicas x 4 sequences x 1 micro-batch instead of 1 x 4 x 2.
    args = ["--override", "tokens.batch_accumulation_per_replica=1", *tiny_overrides(metrics)]
    proc = run_sbatch(env, args, tmp_path)
    assert proc.returncode == 0, f"sbatch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    records = read_metrics(metrics)
    reference = tiny_losses_one_process
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["consumed_tokens"] for r in records] == [r["consumed_tokens"] for r in reference]
    for got, want in zip(records, reference, strict=True):
        assert abs(got["lm_loss"] - want["lm_loss"]) <= REL * abs(want["lm_loss"]), (got, want)
