"""Running lm-evaluation-harness tasks on a checkpoint of ours (`python -m
nanotron_train.evaluate --tasks ...`): the task lookup, the model adapter's token ids, the
harness call and the scores it reports.

lm-eval is an optional dependency (`pip install "nanotron-train[eval]"`); without it `--tasks`
is one clear error. Nothing is downloaded: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE default to 1
(`offline_by_default`, called before the harness or `datasets` is imported), so a task reads
local data files (a task YAML under `--include-path`) or the local Hugging Face cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


class TaskError(ValueError):
    """Tasks that cannot run (unknown, the harness missing); the message says which."""


def offline_by_default() -> None:
    """Nothing is downloaded at run time unless the user set these variables themselves."""
    for name in OFFLINE_VARIABLES:
        os.environ.setdefault(name, "1")


@dataclass
class TaskRun:
    """What to evaluate: harness task (or group) names, folders of extra task YAMLs, and the
    harness's options of the same names."""

    tasks: list[str]
    include_path: list[str] = field(default_factory=list)
    num_fewshot: int | None = None
    limit: float | None = None
    batch_size: int = 16
    bootstrap_iters: int = 100000
    log_samples: bool = False


def _import_harness():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise TaskError(
            "--tasks needs lm-evaluation-harness: pip install 'nanotron-train[eval]' "
            "(the lm-eval package)"
        ) from None


def task_manager(run: TaskRun):
    """The harness's TaskManager: only the --include-path folders when they hold every task
    named (indexing the built-in tasks takes tens of seconds), else the built-in ones too."""
    from lm_eval.tasks import TaskManager

    for folder in run.include_path:
        if not Path(folder).is_dir():
            raise TaskError(f"--include-path {folder}: not a folder")
    if run.include_path:
        local = TaskManager(include_path=run.include_path, include_defaults=False)
        if not _unknown(local, run.tasks):
            return local
    manager = TaskManager(include_path=run.include_path or None)
    unknown = _unknown(manager, run.tasks)
    if unknown:
        where = f" or under --include-path {run.include_path}" if run.include_path else ""
        raise TaskError(f"--tasks: unknown task(s) {unknown}: not a harness task{where}")
    return manager


def _unknown(manager, names: list[str]) -> list[str]:
    return [n for n in names if not manager.match_tasks([n])]


def _token(tok, entry: Any) -> int | None:
    """The id of a tokenizer_config.json special-token entry (a string or {"content": ...})."""
    text = entry.get("content") if isinstance(entry, dict) else entry
    return tok.tokenizer.token_to_id(text) if isinstance(text, str) else None


def exported_token_ids(model_config, tok) -> tuple[int, int]:
    """(eos, bos) as `AutoTokenizer` reads them from this checkpoint's Hugging Face export
    (convert.to_hf copies the tokenizer's tokenizer_config.json, or writes the config's ids):
    the harness's end-of-text token and the prefix of an empty context (bos, else eos)."""
    from nanotron_train.config.token_ids import ids_for_export

    config_file = Path(tok.path).parent / "tokenizer_config.json"
    if config_file.is_file():
        cfg = json.loads(config_file.read_text())
        eos, bos = _token(tok, cfg.get("eos_token")), _token(tok, cfg.get("bos_token"))
    else:
        ids = ids_for_export(model_config, tok)[0]
        eos, bos = ids["eos_token_id"], ids["bos_token_id"]
    eos = tok.eos_token_id if eos is None else eos
    return eos, eos if bos is None else bos


def build_lm(ckpt, model, tok, batch_size: int):
    """The harness model over a loaded `model` (this rank's part) of checkpoint `ckpt`."""
    _import_harness()
    from nanotron_train.config.token_ids import generation_eos
    from nanotron_train.eval.harness_lm import NanotronLM

    eos, bos = exported_token_ids(ckpt.model_config, tok)
    stop = generation_eos(ckpt.model_config, tok)
    return NanotronLM(model, tok, eot=eos, prefix=bos, stop_id=stop, batch_size=batch_size)


def evaluate_tasks(lm, run: TaskRun) -> dict | None:
    """The harness's result dict (`results`, `configs`, `n-samples`, `samples` when logged);
    None on a process with LOCAL_RANK > 0 (the harness reports once per node: every rank of
    the model's group answered the same requests)."""
    _import_harness()
    from lm_eval import simple_evaluate

    manager = task_manager(run)
    try:
        results = simple_evaluate(
            model=lm,
            tasks=list(run.tasks),
            num_fewshot=run.num_fewshot,
            limit=run.limit,
            bootstrap_iters=run.bootstrap_iters,
            log_samples=run.log_samples,
            task_manager=manager,
        )
    except (FileNotFoundError, ConnectionError) as exc:  # a task's data not on this machine
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TaskError(f"--tasks {','.join(run.tasks)}: {first}") from None
    return results


def run_tasks(ckpt, model, run: TaskRun, output_path: str | None) -> dict:
    """The harness's scores per task (and its whole result JSON at `output_path`): what
    `evaluate --tasks` reports for a loaded checkpoint ({} on a process that does not report)."""
    from nanotron_train.inference.model_io import load_tokenizer_of

    lm = build_lm(ckpt, model, load_tokenizer_of(ckpt), run.batch_size)
    results = evaluate_tasks(lm, run)
    if results is None:  # not the reporting process
        return {}
    if output_path and model.pc.rank == 0:
        pc = model.pc
        where = {"checkpoint": str(ckpt.folder), "step": ckpt.step, "tp": pc.tp_size}
        write_results({**results, "nanotron": {**where, "pp": pc.pp_size}}, output_path)
    return {"tasks": scores(results), "n_samples": results.get("n-samples", {})}


def scores(results: dict) -> dict[str, dict[str, float]]:
    """task -> {metric: value} from the harness's results (its `metric,filter` keys kept;
    aliases, the sample count and stderrs it could not compute ("N/A") dropped)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        out[task] = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "sample_len"
        }
    return out


def write_results(results: dict, path: str) -> None:
    """The harness's whole result dict as JSON (what its own --output_path holds)."""
    from lm_eval.utils import handle_non_serializable

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1, default=handle_non_serializable))
