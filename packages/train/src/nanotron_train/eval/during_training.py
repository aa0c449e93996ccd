"""Harness tasks on the run's checkpoints while it trains (the `evaluation` section, or
Nanotron's `lighteval` read as one: config/evaluation.py).

In process (`mode: in_process`): after a checkpoint is saved (and sealed: with async saves,
when the next save begins or at the end), every rank loads that checkpoint's weights at the
run's tp x pp layout (each dp replica the same) into a model of its own and runs the tasks
through the same adapter as `python -m nanotron_train.evaluate --tasks` on that checkpoint, so
the scores are the command's. The training model, its optimizer, data position and RNG
states are not touched (the harness seeds Python's, NumPy's and torch's generators: they are
put back), so the steps after are bitwise the steps without evaluation. The extra model is
freed after; the evaluation's time is not counted in any step's time.

The scores go out as one record per evaluated checkpoint (`score_record`): `step`,
`consumed_tokens` and `eval/<task>/<metric>` (the harness's metric, `/<filter>` when it is not
`none`; stderrs left out), plus `eval/seconds`, through the run's sinks (metrics file,
TensorBoard, W&B, dashboard). An evaluation that fails (unknown task, missing data, an
exception in the harness) is one warning line and an `evaluation_failed` event; training
continues. The ranks agree on the outcome before reporting (a failure on any rank is a
failure).

In a separate job (`mode: separate`) the trainer does nothing: `python -m
nanotron_train.evaluate --watch CHECKPOINTS` (eval/watch.py) evaluates each new checkpoint.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nanotron_train.config.evaluation import EvaluationArgs, evaluation_of


def task_run(settings: EvaluationArgs):
    from nanotron_train.eval.harness import TaskRun

    return TaskRun(
        [t.strip() for t in settings.tasks if t.strip()],
        list(settings.include_path),
        settings.num_fewshot,
        settings.limit,
        settings.batch_size,
        settings.bootstrap_iters,
    )


def due(settings: EvaluationArgs, step: int, last_step: int) -> bool:
    """Whether the checkpoint of `step` is evaluated: every one, or every `interval` steps
    and the last."""
    return settings.interval is None or step % settings.interval == 0 or step >= last_step


def metric_name(task: str, key: str) -> str | None:
    """`eval/<task>/<metric>` for the harness's `metric,filter` key (None: a stderr)."""
    metric, _, flt = key.partition(",")
    if metric.endswith("_stderr"):
        return None
    name = f"eval/{task}/{metric}" + (f"/{flt}" if flt and flt != "none" else "")
    return name.replace(",", "_")  # the dashboard lists names comma-separated


def score_record(step: int, tokens: int | None, tasks: dict[str, dict[str, float]]) -> dict:
    rec: dict[str, Any] = {"step": int(step), "consumed_tokens": tokens}
    for task, metrics in tasks.items():
        for key, value in metrics.items():
            name = metric_name(task, key)
            if name is not None:
                rec[name] = value
    return rec


def score_line(rec: dict) -> str:
    shown = " | ".join(f"{k[5:]}: {v:.6g}" for k, v in rec.items() if k.startswith("eval/"))
    return f"evaluation of checkpoint step {rec['step']} | {shown}"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def evaluate_checkpoint(folder: Path, pc, settings: EvaluationArgs) -> dict:
    """The score record of checkpoint `folder` (every rank of `pc` calls it; collective over
    its tp and pp groups). Raises what the loading or the harness raises."""
    from nanotron_train.eval.harness import run_tasks
    from nanotron_train.inference.model_io import load_model, open_checkpoint

    start = time.perf_counter()
    ckpt = open_checkpoint(folder)
    run = task_run(settings)
    model = load_model(ckpt, pc)
    try:  # what `evaluate --tasks` runs; {} on a process that does not report
        with torch.no_grad():
            tasks = run_tasks(ckpt, model, run, None).get("tasks", {})
    finally:
        del model
        gc.collect()
    rec = score_record(ckpt.step, ckpt.metadata.get("consumed_tokens"), tasks)
    rec["eval/seconds"] = time.perf_counter() - start
    return rec


@contextmanager
def kept_rng() -> Iterator[None]:
    """Python's, NumPy's, torch's and CUDA's generators as they were before (the harness
    seeds them)."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class CheckpointEvaluator:
    """In-process evaluation of the run's checkpoints (the Trainer calls `after_save`)."""

    def __init__(self, settings: EvaluationArgs, pc, last_step: int) -> None:
        from nanotron_train.eval.harness import offline_by_default

        offline_by_default()  # nothing is downloaded during a run
        self.settings, self.pc, self.last_step = settings, pc, last_step
        self.done: set[int] = set()

    def after_save(self, folder: Path, logger, events) -> dict | None:
        """Evaluate a just-saved checkpoint when due; returns its record (rank 0), else None.
        Collective over every rank of the run."""
        step = int(folder.name)
        if step in self.done or not due(self.settings, step, self.last_step):
            return None
        self.done.add(step)
        error, rec = None, None
        with kept_rng():
            try:
                rec = evaluate_checkpoint(folder, self.pc, self.settings)
            except Exception as exc:  # noqa: BLE001 (a failed evaluation never stops training)
                error = first_line(exc)
        if self._any_failed(error is not None) and error is None:
            error = "failed on another rank"
        if self.pc.rank != 0:
            return None
        if error is not None:
            line = f"evaluation of checkpoint {folder} failed: {error}; training continues"
            print(f"warning: step {step}: {line}", file=sys.stderr, flush=True)
            events.emit("evaluation_failed", "warning", line, step, say=False)
            return None
        if logger is not None:
            logger.log_scores(rec, score_line(rec))
        return rec

    def _any_failed(self, failed: bool) -> bool:
        if self.pc.world_size == 1:
            return failed
        flag = torch.tensor([1.0 if failed else 0.0], device=self.pc.device)
        dist.all_reduce(flag)
        return bool(flag.item() > 0)


def build_checkpoint_evaluator(cfg, pc) -> CheckpointEvaluator | None:
    """The in-process evaluator, or None (no evaluation, or a separate job's)."""
    settings = evaluation_of(cfg)
    if settings is None or settings.mode != "in_process":
        if settings is not None and pc.rank == 0:
            root = cfg.checkpoints.checkpoints_path
            print(
                f"evaluation: a separate job evaluates the checkpoints: python -m "
                f"nanotron_train.evaluate --watch {root}",
                flush=True,
            )
        return None
    return CheckpointEvaluator(settings, pc, cfg.tokens.train_steps)
