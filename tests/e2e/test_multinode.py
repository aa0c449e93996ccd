"""Multi-node, rehearsed on one machine: two torchrun agents as two "nodes".

`python -m nanotron_train.launch --nnodes=2 --node_rank=0|1 --nproc_per_node=2` with a c10d
rendezvous on localhost (node 0 hosts the store: `--rdzv-conf is_host=1`), as a SLURM job
starts one agent per node. dp=2 x tp=2: each tp group sits on one node (tp is the fastest
rank dimension), the data-parallel gradient reduction crosses the "nodes". The losses of every
step equal a single process's within 1e-5 relative, and the final checkpoint records the
layout.

With `--max-restarts --resume auto` the job survives the SIGKILL of one node's agent: the other
agent restarts, a replacement node joins the new rendezvous round, and every logged loss equals
the uninterrupted run's bitwise (needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see launching.md).
The uninterrupted run is the first test's (the same config and layout: the restart options
change no value), made once for both.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.dashboard.dashboard_helpers import free_port
from tests.train.fault_helpers import children

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
CHECKPOINT_INTERVAL = 4
REL = 1e-5


def _config(dp: int, tp: int) -> dict:
    return {
        "general": {"project": "test", "run": "multinode", "seed": 5},
        "parallelism": {"dp": dp, "tp": tp, "pp": 1, "tp_mode": "ALL_REDUCE"},
        "model": {
            "model_config": {
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                "max_position_embeddings": 32,
            },
            "init_method": {"std": 0.05},
            "dtype": "float32",
        },
        "tokens": {
            "sequence_length": 16, "micro_batch_size": 2,
            "batch_accumulation_per_replica": 4 // dp, "train_steps": STEPS,
        },
        "optimizer": {
            "learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 1},
            "clip_grad": 1.0,
        },
        "checkpoints": {"checkpoints_path": "ckpt", "checkpoint_interval": CHECKPOINT_INTERVAL},
        "logging": {"iteration_step_info_interval": 1, "metrics_file": "metrics.jsonl"},
    }  # fmt: skip


def _agent(node_rank: int, port: int, cwd: Path, restartable: bool = False) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "nanotron_train.launch",
        "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=rehearsal",
        "--rdzv-conf", f"is_host={int(node_rank == 0)}",
        "--config-file", "cfg.yaml",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if restartable:
        cmd += ["--max-restarts=2", "--monitor-interval=0.2", "--resume", "auto"]
        # A fresh store per rendezvous round: with the shared agent store a replacement node
        # waits forever for the bootstrap address the restarted rank-0 agent never republishes.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.pop("NANOTRON_DASHBOARD_URL", None)
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the cleanup ends the agent's workers
    )


def _single_process_losses() -> list[float]:
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import train

    cfg = _config(dp=1, tp=1)
    del cfg["checkpoints"], cfg["logging"]["metrics_file"]
    records: list[dict] = []
    torch.set_num_threads(1)
    train(config_from_dict(cfg), stream=io.StringIO(), on_record=records.append)
    return [r["lm_loss"] for r in records]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[Path, list[int], list[str]]:
    """The uninterrupted two-agent run (dp=2 x tp=2): its folder, exit codes and outputs."""
    tmp = tmp_path_factory.mktemp("two-nodes")
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(_config(dp=2, tp=2)))
    port = free_port()
    agents = [_agent(0, port, tmp), _agent(1, port, tmp)]
    try:
        outputs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    return tmp, [a.returncode for a in agents], outputs


def test_two_agents_as_two_nodes_train_as_one_process(two_nodes):
    run_dir, codes, outputs = two_nodes
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    reference = _single_process_losses()
    assert [r["lm_loss"] for r in logged] == pytest.approx(reference, rel=REL)
    meta = json.loads((run_dir / "ckpt" / str(STEPS) / "checkpoint_metadata.json").read_text())
    assert {k: meta["topology"][k] for k in ("dp", "tp", "pp")} == {"dp": 2, "tp": 2, "pp": 1}


def _logged(tmp: Path) -> list[dict]:
    path = tmp / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_restarting_agents_survive_the_loss_of_a_node(tmp_path, two_nodes):
    # The uninterrupted run with the same layout: the losses must match it bitwise.
    ref_dir, codes, ref_outputs = two_nodes
    assert codes == [0, 0], "\n".join(o[-3000:] for o in ref_outputs)
    reference = {r["step"]: r["lm_loss"] for r in _logged(ref_dir)}
    assert sorted(reference) == list(range(1, STEPS + 1))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "cfg.yaml").write_text(yaml.safe_dump(_config(dp=2, tp=2)))
    agents: list[subprocess.Popen] = []
    try:
        # Node 1 dies mid-run (its agent SIGKILLed: its workers leave by themselves); agent 0's
        # workers fail, it restarts and waits in a new rendezvous round, where a replacement
        # node 1 (the same command, as a scheduler starts it) joins; both resume from the latest
        # checkpoint.
        port = free_port()
        agents = [_agent(r, port, run_dir, restartable=True) for r in (0, 1)]
        _wait_for(lambda: len(_logged(run_dir)) >= 6, "step 6")
        os.killpg(agents[1].pid, signal.SIGKILL)
        agents[1].wait()
        first = set(children(agents[0].pid))
        _wait_for(lambda: not set(children(agents[0].pid)) & first, "agent 0's workers to fail")
        agents.append(_agent(1, port, run_dir, restartable=True))
        outputs = [agents[0].communicate(timeout=240)[0], agents[2].communicate(timeout=240)[0]]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    assert [agents[0].returncode, agents[2].returncode] == [0, 0], "\n".join(
        o[-3000:] for o in outputs
    )
    logged = _logged(run_dir)
    assert {r["step"] for r in logged} == set(range(1, STEPS + 1))
    assert logged[-1]["step"] == STEPS
    # Whichever attempt logged a step, its loss is the uninterrupted one.
    assert [(r["step"], r["lm_loss"]) for r in logged] == [
        (r["step"], reference[r["step"]]) for r in logged
    ]
    # The restarted attempt loaded a checkpoint (printed by global rank 0: on either node, as
    # the new rendezvous round numbers the nodes in the order they joined).
    assert "resumed from" in outputs[0] + outputs[1], "\n".join(o[-3000:] for o in outputs)
