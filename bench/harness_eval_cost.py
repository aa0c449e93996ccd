"""Cost of a downstream evaluation per checkpoint against a training step, in process and as a
separate job (the `evaluation` section, docs/evaluation.md).

One process trains a small Llama (synthetic tokens, a tokenizer built here) for --steps steps
with a checkpoint every --interval steps, each evaluated on configs/eval-tasks' three tasks
(multiple choice, perplexity, generation). Measured:

- in process: the evaluation's time per checkpoint (`eval/seconds` of its record: loading the
  checkpoint, the harness, the tasks), during which the training waits, over the median
  training step (`time_per_iteration_ms` of the other records): training steps lost per
  checkpoint;
- separate: the same run with `mode: separate` and `python -m nanotron_train.evaluate --watch`
  started beside it (its own process): the training waits for nothing; the job's time per
  checkpoint (its records' `eval/seconds`) over the training step, and the training steps'
  median with the job running beside them (on a machine whose cores both share, the job slows
  them) over the in-process run's.

Run from the repository root (the task YAMLs name their data files relative to it):

    .venv/bin/python bench/harness_eval_cost.py [--steps 12] [--interval 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TASKS = ["tiny_code_mc", "tiny_code_ppl", "tiny_code_gen"]


def config(args, root: Path, tok: Path, mode: str) -> dict:
    return {
        "general": {"project": "bench", "run": f"eval_{mode}", "seed": 1},
        "model": {
            "model_config": {
                "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
                "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
                "num_key_value_heads": args.hidden // 64, "vocab_size": 4096,
                "max_position_embeddings": args.seq,
            },
            "dtype": "float32",
        },
        "tokenizer": {"tokenizer_name_or_path": str(tok)},
        "tokens": {"sequence_length": args.seq, "micro_batch_size": args.mbs,
                   "batch_accumulation_per_replica": 1, "train_steps": args.steps},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-4}},
        "checkpoints": {"checkpoints_path": str(root / mode / "ck"),
                        "checkpoint_interval": args.interval},
        "logging": {"metrics_file": str(root / mode / "metrics.jsonl")},
        "evaluation": {"tasks": TASKS, "include_path": ["configs/eval-tasks"], "mode": mode,
                       "bootstrap_iters": 0},
    }  # fmt: skip


def train_run(raw: dict) -> list[dict]:
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import train

    records: list[dict] = []
    train(config_from_dict(raw, "bench"), stream=io.StringIO(), on_record=records.append)
    return records


def step_seconds(records: list[dict]) -> float:
    """The median step (the first, with its warm-up, left out)."""
    return statistics.median(r["time_per_iteration_ms"] / 1e3 for r in records[1:])


def eval_seconds(path: Path) -> list[float]:
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    return [r["eval/seconds"] for r in lines if "eval/seconds" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--interval", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=8)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    torch.set_num_threads(1)  # a shared machine: one core each, the job another
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok = make_tokenizer(root / "tok", tiny_texts(200), vocab_size=4096)
        inproc = train_run(config(args, root, tok, "in_process"))
        ck = root / "separate" / "ck"
        ck.mkdir(parents=True)
        results = root / "separate" / "scores.jsonl"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        job = subprocess.Popen(
            [sys.executable, "-m", "nanotron_train.evaluate", "--watch", str(ck), "--poll-s",
             "0.5", "--metrics-file", str(results), "--idle-timeout-s", "600"],
            env=env, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        separate = train_run(config(args, root, tok, "separate"))
        job.wait(timeout=1200)
        in_eval = eval_seconds(root / "in_process" / "metrics.jsonl")
        sep_eval = eval_seconds(results)
    step_in, step_sep = step_seconds(inproc), step_seconds(separate)
    e_in, e_sep = statistics.median(in_eval), statistics.median(sep_eval)
    tokens = args.mbs * args.seq
    print(f"hidden {args.hidden}, layers {args.layers}, seq {args.seq}, mbs {args.mbs} "
          f"({tokens} tokens/step), CPU, 1 thread each; tasks {','.join(TASKS)}; "
          f"{len(in_eval)} / {len(sep_eval)} checkpoints evaluated")  # fmt: skip
    print(f"in process: training step {step_in * 1e3:.0f} ms, evaluation per checkpoint "
          f"{e_in:.2f} s (training waits): ratio {e_in / step_in:.1f} steps")  # fmt: skip
    print(f"separate: training waits 0 s; the job's evaluation per checkpoint {e_sep:.2f} s = "
          f"{e_sep / step_sep:.1f} training steps of time; training step with the job beside "
          f"it {step_sep * 1e3:.0f} ms ({step_sep / step_in:.2f}x the in-process run's)")  # fmt: skip


if __name__ == "__main__":
    main()
