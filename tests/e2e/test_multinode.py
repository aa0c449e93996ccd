"""Multi-node, rehearsed on one machine: two torchrun agents as two "nodes".

`python -m nanotron_train.launch --nnodes=2 --node_rank=0|1 --nproc_per_node=2` with a c10d
rendezvous on localhost (node 0 hosts the store: `--rdzv-conf is_host=1`), as a SLURM job
starts one agent per node. dp=2 x tp=2: each tp group sits on one node (tp is the fastest
rank dimension), the data-parallel gradient reduction crosses the "nodes". The losses of every
step equal a single process's within 1e-5 relative, and the final checkpoint records the
layout.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.dashboard.dashboard_helpers import free_port

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
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
        "checkpoints": {"checkpoints_path": "ckpt", "checkpoint_interval": STEPS},
        "logging": {"iteration_step_info_interval": 1, "metrics_file": "metrics.jsonl"},
    }  # fmt: skip


def _agent(node_rank: int, port: int, cwd: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "nanotron_train.launch",
        "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=rehearsal",
        "--rdzv-conf", f"is_host={int(node_rank == 0)}",
        "--config-file", "cfg.yaml",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
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


def test_two_agents_as_two_nodes_train_as_one_process(tmp_path):
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(_config(dp=2, tp=2)))
    port = free_port()
    agents = [_agent(0, port, tmp_path), _agent(1, port, tmp_path)]
    try:
        outputs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    reference = _single_process_losses()
    assert [r["lm_loss"] for r in logged] == pytest.approx(reference, rel=REL)
    meta = json.loads((tmp_path / "ckpt" / str(STEPS) / "checkpoint_metadata.json").read_text())
    assert {k: meta["topology"][k] for k in ("dp", "tp", "pp")} == {"dp": 2, "tp": 2, "pp": 1}
