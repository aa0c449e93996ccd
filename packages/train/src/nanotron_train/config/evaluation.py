"""Downstream evaluation during training: our `evaluation` section and Nanotron's `lighteval`
keys read as one (eval/during_training.py runs it, `evaluate --watch` the separate job).

- `tasks`: lm-evaluation-harness task (or group) names; `include_path`: folders of task YAMLs
  over local data files; `limit`, `num_fewshot`, `batch_size`, `bootstrap_iters`: the harness's
  options of the same names (`python -m nanotron_train.evaluate --tasks` takes them too).
- `interval`: evaluate the checkpoints whose step is a multiple of it (and the last); null =
  every checkpoint. A multiple of checkpoints.checkpoint_interval (only checkpoints are
  evaluated).
- `mode`: `in_process` (every rank, between steps, at the run's tp x pp layout) or `separate`
  (the trainer never waits: `python -m nanotron_train.evaluate --watch CHECKPOINTS` evaluates
  each new checkpoint; `pp` is that job's pipeline stages).

Nanotron's `lighteval` section (which sends each saved checkpoint to a separate evaluation
job) is read as `mode: separate` with: `tasks.tasks` (lighteval's `suite|task|fewshot|truncate`
specs: the harness task named `task`, `fewshot` its few-shot count), `tasks.custom_tasks` (a
folder of task YAMLs: the include path), `tasks.max_samples` (limit), `batch_size`,
`eval_interval` and `parallelism.pp`. Its other keys (slurm, s3, hub and wandb uploads,
generation, ...) have no meaning here: one warning names those given, as do lighteval's task
specs that cannot map. With both sections, `evaluation` is used and `lighteval` warned about.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nanotron_train.config.rules import Check

Config = Any  # config/schema.py's Config (which imports this module)


@dataclass
class EvaluationArgs:
    tasks: list[str] = field(default_factory=list)
    include_path: list[str] = field(default_factory=list)
    interval: int | None = None  # steps (a multiple of checkpoint_interval); null: every save
    limit: float | None = None  # examples per task (< 1: a fraction)
    num_fewshot: int | None = None
    batch_size: int = 16
    bootstrap_iters: int = 100000
    mode: Literal["in_process", "separate"] = "in_process"
    pp: int = 1  # separate mode: the evaluation job's pipeline stages (tp = its processes / pp)


# lighteval keys read here (dotted); every other key given a value is named in one warning
_LIGHTEVAL_USED = {"tasks.tasks", "tasks.custom_tasks", "tasks.max_samples", "batch_size",
                   "eval_interval", "parallelism.pp"}  # fmt: skip


# Nanotron's defaults (LightEvalConfig's __post_init__ fills some in, so a config it saved has
# them): no warning for a key left at one
_LIGHTEVAL_DEFAULTS = {
    "parallelism.dp": 1, "parallelism.tp": 1, "parallelism.tp_linear_async_communication": True,
    "tasks.dataset_loading_processes": 8, "upload_to_wandb": False, "nanotron_path": "./",
    "slurm_script_dir": "eval_results/launch-config", "logs_path": "eval_results/logs",
    "local_checkpoint_dir": "/scratch", "slurm.gpus_per_node": 8,
    "slurm.partition": "hopper-prod", "slurm.hf_cache": "~/.cache/huggingface",
    "slurm.cpus_per_task": 88, "slurm.qos": "high", "slurm.time": "24:00:00",
    "slurm.reservation": "smollm",
}  # fmt: skip


def _flat(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def from_lighteval(raw: dict[str, Any]) -> tuple[EvaluationArgs | None, list[str]]:
    """Nanotron's `lighteval` mapping as an EvaluationArgs (None: no tasks to run) and the
    warnings about what does not map."""
    flat = {k: v for k, v in _flat(raw).items() if v is not None}
    warnings = []
    unused = sorted(
        k for k, v in flat.items() if k not in _LIGHTEVAL_USED and _LIGHTEVAL_DEFAULTS.get(k) != v
    )
    if unused:
        warnings.append(
            f"lighteval keys {', '.join(unused)} have no meaning here and are ignored (the "
            "checkpoints are evaluated by `python -m nanotron_train.evaluate --watch`)"
        )
    tasks, fewshots = [], set()
    for spec in str(flat.get("tasks.tasks") or "").split(","):
        parts = [p.strip() for p in spec.split("|")]
        if not parts[0]:
            continue
        name = parts[1] if len(parts) > 1 else parts[0]
        if len(parts) > 2 and parts[2].isdigit():
            fewshots.add(int(parts[2]))
        tasks.append(name)
    if len(fewshots) > 1:
        warnings.append(
            f"lighteval.tasks.tasks: few-shot counts {sorted(fewshots)} differ between tasks; "
            "each task runs with its own default"
        )
    args = EvaluationArgs(tasks=tasks, mode="separate")
    args.num_fewshot = fewshots.pop() if len(fewshots) == 1 else None
    custom = flat.get("tasks.custom_tasks")
    if custom and Path(str(custom)).is_dir():
        args.include_path = [str(custom)]
    elif custom:
        warnings.append(
            f"lighteval.tasks.custom_tasks {custom!r}: not a folder of harness task YAMLs; ignored"
        )
    if flat.get("tasks.max_samples"):
        args.limit = float(flat["tasks.max_samples"])
    args.batch_size = int(flat.get("batch_size") or args.batch_size)
    args.interval = int(flat["eval_interval"]) if flat.get("eval_interval") else None
    args.pp = int(flat.get("parallelism.pp") or 1)
    if not tasks:
        warnings.append("lighteval.tasks.tasks names no task: nothing is evaluated")
        return None, warnings
    return args, warnings


def evaluation_of(cfg: Config) -> EvaluationArgs | None:
    """The run's evaluation settings: its `evaluation` section, else its `lighteval` one."""
    if cfg.evaluation is not None:
        return cfg.evaluation
    if isinstance(cfg.lighteval, dict):
        return from_lighteval(cfg.lighteval)[0]
    return None


def evaluation_warnings(cfg: Config) -> list[str]:
    """One line per thing of the `lighteval` section that has no meaning here."""
    if not isinstance(cfg.lighteval, dict):
        return []
    if cfg.evaluation is not None:
        return ["the lighteval section is ignored: the evaluation section is used"]
    lines = from_lighteval(cfg.lighteval)[1]
    if not cfg.checkpoints.checkpoints_path:
        lines.append("lighteval: no checkpoints.checkpoints_path: no checkpoint to evaluate")
    interval, every = evaluation_of(cfg), cfg.checkpoints.checkpoint_interval
    if interval is not None and interval.interval and interval.interval % every:
        lines.append(
            f"lighteval.eval_interval {interval.interval} is not a multiple of "
            f"checkpoints.checkpoint_interval {every}: only checkpoints at multiples of both "
            "are evaluated"
        )
    return lines


def _ours(c: Config) -> EvaluationArgs | None:
    return c.evaluation


def _interval_ok(c: Config) -> bool:
    ev = c.evaluation
    return (
        ev is None
        or ev.interval is None
        or (ev.interval >= 1 and ev.interval % c.checkpoints.checkpoint_interval == 0)
    )


def _in_process_layout_ok(c: Config) -> bool:
    ev = evaluation_of(c)
    par = c.parallelism
    in_process = ev is not None and ev.mode == "in_process"
    return not in_process or (par.context_parallel_size == 1 and par.expert_parallel_size == 1)


EVALUATION_CHECKS: tuple[Check, ...] = (
    Check(
        "evaluation.tasks",
        lambda c: _ours(c) is None or any(t.strip() for t in c.evaluation.tasks),
        "names no task: give lm-evaluation-harness task names (a list)",
    ),
    Check(
        "evaluation",
        lambda c: _ours(c) is None or bool(c.checkpoints.checkpoints_path),
        "evaluates the run's checkpoints: set checkpoints.checkpoints_path",
    ),
    Check(
        "evaluation.interval",
        _interval_ok,
        lambda c: (
            f"must be null (every checkpoint) or a multiple of checkpoints.checkpoint_interval "
            f"({c.checkpoints.checkpoint_interval}), got {c.evaluation.interval}"
        ),
    ),
    Check(
        "evaluation.limit",
        lambda c: _ours(c) is None or c.evaluation.limit is None or c.evaluation.limit > 0,
        lambda c: (
            f"must be > 0 (examples per task; < 1: a fraction) or null, got {c.evaluation.limit}"
        ),
    ),
    Check(
        "evaluation.batch_size",
        lambda c: _ours(c) is None or c.evaluation.batch_size >= 1,
        lambda c: f"must be >= 1, got {c.evaluation.batch_size}",
    ),
    Check(
        "evaluation.pp",
        lambda c: _ours(c) is None or c.evaluation.pp >= 1,
        lambda c: f"must be >= 1, got {c.evaluation.pp}",
    ),
    Check(
        "evaluation.mode",
        _in_process_layout_ok,
        "in_process does not run under context or expert parallelism: use mode: separate "
        "(`python -m nanotron_train.evaluate --watch`)",
    ),
    Check(
        "evaluation",
        lambda c: _ours(c) is None or bool(c.tokenizer.tokenizer_name_or_path),
        "the harness reads text: set tokenizer.tokenizer_name_or_path",
    ),
)
