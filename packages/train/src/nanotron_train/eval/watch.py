"""`python -m nanotron_train.evaluate --watch CHECKPOINTS`: the separate evaluation job of a run
(`evaluation.mode: separate`, or Nanotron's `lighteval` section), so that training never waits.

It polls the checkpoints folder; each complete checkpoint not evaluated yet (and due: every
one, or every `evaluation.interval` steps and the last) is evaluated, in step order, exactly as
`python -m nanotron_train.evaluate --ckpt-path FOLDER --tasks ...` would (eval/during_training.py
`evaluate_checkpoint`, at tp x pp = this job's processes, `--pp` or `evaluation.pp`). The tasks
are the flags' (`--tasks`, ...), else the checkpoints' own config.yaml `evaluation` (or
`lighteval`) section. It stops once the run's last step (tokens.train_steps) is evaluated, or
after `--idle-timeout-s` seconds without a new checkpoint (0: never).

Each evaluated checkpoint's record (`step`, `consumed_tokens`, `eval/<task>/<metric>`, with the
run's `run_id`) is appended to `--metrics-file` (default CHECKPOINTS/evaluation_metrics.jsonl:
the steps it holds are not evaluated again, so a restarted watcher continues), written to the
run's TensorBoard folder (its own event file there) and sent to the dashboard as the run's
metrics (the run's `logging.dashboard_url`, or NANOTRON_DASHBOARD_URL). A checkpoint whose
evaluation fails is one warning line, an `evaluation_failed` event and a record with
`evaluation_error`; the watcher goes on.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from nanotron_train.config.evaluation import EvaluationArgs, from_lighteval
from nanotron_train.eval.during_training import (
    due,
    evaluate_checkpoint,
    first_line,
    kept_rng,
    score_line,
)

RESULTS_NAME = "evaluation_metrics.jsonl"


def settings_from_config(folder: Path) -> EvaluationArgs:
    """The `evaluation` (or `lighteval`) section of a checkpoint's config.yaml."""
    from nanotron_train.config.loader import from_dict

    path = folder / "config.yaml"
    raw = _train_config(folder)
    if isinstance(raw.get("evaluation"), dict):
        return from_dict(EvaluationArgs, raw["evaluation"], "evaluation", str(path))
    if isinstance(raw.get("lighteval"), dict):
        settings = from_lighteval(raw["lighteval"])[0]
        if settings is not None:
            return settings
    raise ValueError(
        f"{path}: no evaluation section names the tasks: give --tasks a,b [--include-path DIR]"
    )


def _train_config(folder: Path) -> dict:
    path = folder / "config.yaml"
    raw = yaml.safe_load(path.read_text()) if path.is_file() else {}
    return raw if isinstance(raw, dict) else {}


class WatchSinks:
    """Rank 0's outputs: the results file, the run's TensorBoard folder, the dashboard."""

    def __init__(self, results: Path, stream=sys.stdout) -> None:
        self.results, self.stream = results, stream
        self._tb = self._dashboard = None
        self._opened = False

    def done_steps(self) -> set[int]:
        if not self.results.is_file():
            return set()
        steps = set()
        for line in self.results.read_text().splitlines():
            try:
                steps.add(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash: evaluated again
        return steps

    def _open(self, folder: Path, meta: dict) -> None:
        """The run's sinks, from the first checkpoint's config and metadata."""
        if self._opened:
            return
        self._opened = True
        logging_cfg = _train_config(folder).get("logging") or {}
        run_id = meta.get("run_id") if isinstance(meta.get("run_id"), str) else None
        if logging_cfg.get("tensorboard_dir"):
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(logging_cfg["tensorboard_dir"], filename_suffix=".eval")
            except ImportError:
                print("warning: tensorboard is not installed: no TensorBoard scores", flush=True)
        if run_id:
            from nanotron_train.reporting.dashboard_sink import client_from_config

            self._dashboard = client_from_config(logging_cfg.get("dashboard_url"), run_id=run_id)

    def write(self, folder: Path, meta: dict, rec: dict) -> None:
        self._open(folder, meta)
        run_id = meta.get("run_id")
        self.results.parent.mkdir(parents=True, exist_ok=True)
        with self.results.open("a") as f:
            f.write(json.dumps({**rec, "run_id": run_id}) + "\n")
        if "evaluation_error" in rec:
            line = f"evaluation of checkpoint {folder} failed: {rec['evaluation_error']}"
            print(f"warning: step {rec['step']}: {line}", file=sys.stderr, flush=True)
            if self._dashboard is not None:
                self._dashboard.event("evaluation_failed", "warning", line, rec["step"], {})
            return
        print(score_line(rec), file=self.stream, flush=True)
        scalars = {k: v for k, v in rec.items() if k.startswith("eval/")}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, rec["step"])
            self._tb.flush()
        if self._dashboard is not None:
            tokens = rec.get("consumed_tokens")
            extra = {"consumed_tokens": tokens} if tokens is not None else {}
            self._dashboard.metrics(rec["step"], {**scalars, **extra})

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._dashboard is not None:
            self._dashboard.close(10.0)


def _agreed(pc, value: Any) -> Any:
    """Rank 0's `value` on every rank (the ranks list the folder at different moments)."""
    if pc.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _pending(root: Path, done: set[int]) -> list[tuple[int, str, dict]]:
    """(step, folder, metadata) of the complete checkpoints not evaluated yet, by step."""
    from nanotron_train.checkpoints.listing import list_checkpoints
    from nanotron_train.checkpoints.metadata import read_metadata

    out = []
    for entry in list_checkpoints(root):
        if entry.complete and entry.step not in done:
            out.append((entry.step, entry.path, read_metadata(Path(entry.path))))
    return out


def watch(root: Path, pc, flags: EvaluationArgs | None, sinks: WatchSinks | None,
          poll_s: float = 10.0, idle_timeout_s: float = 0.0) -> list[int]:  # fmt: skip
    """Evaluate each new checkpoint under `root` until the run's last step is evaluated (or
    `idle_timeout_s` passes without one); returns the steps evaluated. Every rank of `pc`
    calls it; `sinks` on rank 0 only."""
    done = _agreed(pc, sinks.done_steps() if sinks is not None else None)
    evaluated: list[int] = []
    idle_since = time.monotonic()
    while True:
        pending = _agreed(pc, _pending(root, done) if pc.rank == 0 else None)
        finished = False
        for step, path, meta in pending:
            folder = Path(path)
            settings = flags or settings_from_config(folder)
            last = int((_train_config(folder).get("tokens") or {}).get("train_steps") or 0)
            done.add(step)
            finished = finished or (last > 0 and step >= last)
            if not due(settings, step, last):
                continue
            rec = _evaluate(folder, pc, settings, step, meta)
            evaluated.append(step)
            if sinks is not None:
                sinks.write(folder, meta, rec)
        if pending:
            idle_since = time.monotonic()
        if finished or (idle_timeout_s > 0 and time.monotonic() - idle_since > idle_timeout_s):
            return evaluated
        time.sleep(poll_s)


def _evaluate(folder: Path, pc, settings: EvaluationArgs, step: int, meta: dict) -> dict:
    error = None
    try:
        with kept_rng():
            rec = evaluate_checkpoint(folder, pc, settings)
    except Exception as exc:  # noqa: BLE001 (one checkpoint's failure does not stop the job)
        error = first_line(exc)
    if pc.world_size > 1:  # a failure on any rank is the checkpoint's
        errors: list[str | None] = [None] * pc.world_size
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        return {"step": step, "consumed_tokens": meta.get("consumed_tokens"),
                "evaluation_error": error}  # fmt: skip
    return rec
