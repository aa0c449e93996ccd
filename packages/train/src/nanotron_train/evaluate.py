"""`torchrun --nproc_per_node=N -m nanotron_train.evaluate --ckpt-path CKPT --dataset-folder DIR`

Measures a checkpoint (saved in any layout) on held-out Nanoset folders at tp = N, pp = 1: the
token-weighted loss over the validation set, its perplexity and the tokens evaluated. The
samples, their order and the batch size are those of training's evaluation (data/validation.py,
one batch = the run's global batch), so `--limit-batches B` measures what
`tokens.limit_val_batches: B` measured during training, and the same val_loss comes out.
`--split F` evaluates the documents a run with `validation.split: F` held out of DIR;
`--eod-mask-loss` masks the labels after document ends, as a run with `eod_mask_loss: true`.
`python -m nanotron_train.evaluate ...` runs one process; `--json` prints one JSON object.

`--tasks a,b [--include-path DIR]` runs lm-evaluation-harness tasks on the checkpoint
(eval/harness.py, the model adapter eval/harness_lm.py; needs the `eval` extra): the harness's
own tasks or task YAMLs over local data files, at tp x pp = the processes (`--pp`, default 1),
nothing downloaded. With both `--dataset-folder` and `--tasks`, both are measured.
`--watch CHECKPOINTS` is a run's separate evaluation job: each new checkpoint evaluated
(eval/watch.py), with the tasks of the flags or of the run's `evaluation` section.
A user error (a folder tokenized with another tokenizer than the checkpoint's, ids beyond its
vocabulary, a bad checkpoint, an unknown task) prints one line from rank 0 and exits with
status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from nanotron_train.inference.model_io import TOKENIZER_HELP
from nanotron_train.launching.tp_command import run_over_tp
from nanotron_train.process_exit import exit_process


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m nanotron_train.evaluate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--ckpt-path", help="a checkpoint step folder or checkpoints root")
    p.add_argument("--dataset-folder", action="append", help="a Nanoset folder (repeatable)")
    p.add_argument(
        "--limit-batches", type=int, default=0, help="validation batches to evaluate (0 = all)"
    )
    p.add_argument("--split", type=float, help="evaluate only the held-out documents of a split")
    p.add_argument(
        "--eod-mask-loss",
        action="store_true",
        help="leave out the label after each document's end (as a run with eod_mask_loss)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--tokenizer", help=TOKENIZER_HELP)
    add_task_args(p)
    add_watch_args(p)
    return p.parse_args(argv)


def add_watch_args(p: argparse.ArgumentParser) -> None:
    """The separate evaluation job of a run (eval/watch.py)."""
    w = p.add_argument_group("evaluating each new checkpoint of a run (a separate job)")
    w.add_argument("--watch", metavar="CHECKPOINTS", help="a run's checkpoints folder to watch")
    w.add_argument("--poll-s", type=float, default=10.0, help="seconds between looks")
    w.add_argument(
        "--idle-timeout-s", type=float, default=0.0,
        help="stop after this long without a new checkpoint (0: at the run's last step only)",
    )  # fmt: skip
    w.add_argument(
        "--metrics-file", help="the records' JSON lines file (CHECKPOINTS/evaluation_metrics.jsonl)"
    )


def add_task_args(p: argparse.ArgumentParser) -> None:
    """The lm-evaluation-harness options (named as the harness's own command names them)."""
    h = p.add_argument_group("lm-evaluation-harness tasks")
    h.add_argument("--tasks", help="comma-separated harness task or group names")
    h.add_argument(
        "--include-path", action="append", default=[], help="a folder of task YAMLs (repeatable)"
    )
    h.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    h.add_argument("--limit", type=float, help="examples per task (< 1: a fraction of them)")
    h.add_argument("--batch-size", type=int, default=16, help="requests per forward")
    h.add_argument("--bootstrap-iters", type=int, default=100000, help="for metric stderrs")
    h.add_argument("--pp", type=int, help="pipeline stages (the processes are pp x tp; default 1)")
    h.add_argument("--output-path", help="write the harness's whole result JSON to this file")
    h.add_argument(
        "--log-samples", action="store_true", help="keep each example's requests and answers"
    )


def task_run(args: argparse.Namespace):
    from nanotron_train.eval.harness import TaskRun

    names = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if args.tasks is not None and not names:
        raise ValueError("--tasks: no task name given")
    return TaskRun(
        names,
        list(args.include_path),
        args.num_fewshot,
        args.limit,
        args.batch_size,
        args.bootstrap_iters,
        args.log_samples,
    )


def expected_tokenizer(ckpt) -> tuple[str, str] | None:
    """(what, sha256) of the tokenizer the checkpoint was trained with: its config's tokenizer,
    else its training folders' metadata; None for a run on synthetic data (nothing to match)."""
    from nanotron_train.data import DataError, Nanoset, load_tokenizer

    if ckpt.tokenizer_path:
        try:
            return f"the checkpoint's tokenizer {ckpt.tokenizer_path}", load_tokenizer(
                ckpt.tokenizer_path
            ).sha256
        except DataError:
            pass  # not on this machine: the training folders name it too
    folders = []
    for stage in ckpt.train_config.get("data_stages") or []:
        dataset = ((stage or {}).get("data") or {}).get("dataset") or {}
        found = dataset.get("dataset_folder") or []
        folders += [found] if isinstance(found, str) else list(found)
    for folder in folders:
        try:
            sha = Nanoset(folder).metadata.tokenizer.get("sha256")
        except DataError:
            continue
        return f"the checkpoint's training data {folder}", str(sha)
    if ckpt.tokenizer_path or folders:
        raise DataError(
            f"cannot tell which tokenizer {ckpt.folder} was trained with: neither its tokenizer "
            f"{ckpt.tokenizer_path!r} nor its training folders {folders} are readable here"
        )
    return None


def run(args: argparse.Namespace, pc) -> dict:
    """Evaluate on every rank of `pc`; returns the report (the same on every rank)."""
    from nanotron_train.eval.harness import run_tasks
    from nanotron_train.inference.model_io import load_model, open_checkpoint

    ckpt = open_checkpoint(args.ckpt_path, args.tokenizer)
    tasks = task_run(args)
    loss = loss_data(args, ckpt) if args.dataset_folder else None
    model = load_model(ckpt, pc)
    report: dict = {"checkpoint": str(ckpt.folder), "step": ckpt.step, "tp": pc.tp_size}
    report["pp"] = pc.pp_size
    if loss is not None:
        report.update(measure_loss(model, pc, loss, args.dataset_folder))
    if tasks.tasks:
        report.update(run_tasks(ckpt, model, tasks, args.output_path))
    return report


def measure_loss(model, pc, data, folders: list[str]) -> dict:
    from nanotron_train.eval.evaluation import Evaluator

    result = Evaluator(model, pc, "1f1b", data).evaluate()
    return {
        "dataset_folder": list(folders),
        "val_loss": result.loss,
        "val_ppl": result.ppl,
        "tokens": result.tokens,
        "batches": data.num_batches,
        "samples": data.num_samples,
    }


def loss_data(args: argparse.Namespace, ckpt):
    """The validation batches of the --dataset-folder Nanosets, as training sized them."""
    from nanotron_train.data import DataError, Nanoset
    from nanotron_train.data.split import split_by_documents
    from nanotron_train.data.validation import ValidationData

    tokens = ckpt.train_config.get("tokens") or {}
    dp = int((ckpt.train_config.get("parallelism") or {}).get("dp", 1))
    try:
        seq, mbs = int(tokens["sequence_length"]), int(tokens["micro_batch_size"])
        accum = int(tokens["batch_accumulation_per_replica"])
    except (KeyError, TypeError, ValueError):
        raise DataError(
            f"{ckpt.folder / 'config.yaml'}: no tokens section to size the batches"
        ) from None
    expected = expected_tokenizer(ckpt)
    nanosets = []
    for folder in args.dataset_folder:
        ns = Nanoset(folder, model_vocab_size=ckpt.model_config.vocab_size)
        sha = str(ns.metadata.tokenizer.get("sha256"))
        if expected is not None and sha != expected[1]:
            raise DataError(
                f"{folder} was tokenized with another tokenizer (sha256 {sha[:12]}) than "
                f"{expected[0]} ({expected[1][:12]})"
            )
        nanosets.append(split_by_documents(ns, args.split, seq)[1] if args.split else ns)
    return ValidationData(
        nanosets,
        None,
        sequence_length=seq,
        micro_batch_size=mbs,
        batch_accumulation_per_replica=accum * dp,  # one batch = the run's global batch
        dp_rank=0,
        dp_size=1,
        limit_batches=args.limit_batches,
        eod_mask_loss=args.eod_mask_loss,
        document_masking=ckpt.model_config.document_masking,
    )


def print_report(report: dict) -> None:
    where = f"checkpoint: {report['checkpoint']} (step {report['step']})"
    if "val_loss" in report:
        print(
            f"{where} | val_loss: {report['val_loss']:.6g} | val_ppl: {report['val_ppl']:.6g} | "
            f"tokens: {report['tokens']} | batches: {report['batches']} (tp={report['tp']})",
            flush=True,
        )
    for task, metrics in report.get("tasks", {}).items():
        shown = " | ".join(f"{k}: {v:.6g}" for k, v in metrics.items())
        print(f"{where} | task {task} | {shown} (tp={report['tp']}, pp={report['pp']})")


def watch_main(args: argparse.Namespace) -> int:
    """`--watch CHECKPOINTS`: evaluate each new checkpoint of a run (eval/watch.py)."""
    from pathlib import Path

    from nanotron_train.config.evaluation import EvaluationArgs
    from nanotron_train.eval.watch import RESULTS_NAME, WatchSinks, settings_from_config, watch

    root = Path(args.watch)
    flags = None
    if args.tasks is not None:
        run = task_run(args)
        flags = EvaluationArgs(
            tasks=run.tasks, include_path=run.include_path, limit=run.limit,
            num_fewshot=run.num_fewshot, batch_size=run.batch_size,
            bootstrap_iters=run.bootstrap_iters, mode="separate", pp=args.pp or 1,
        )  # fmt: skip
    if not root.is_dir():
        print(f"error: --watch {root}: no such checkpoints folder", file=sys.stderr)
        return 2
    pp = args.pp or (flags.pp if flags else _configured_pp(root, settings_from_config))

    def work(pc) -> dict:
        sinks = WatchSinks(Path(args.metrics_file or root / RESULTS_NAME)) if pc.rank == 0 else None
        try:
            return {"evaluated": watch(root, pc, flags, sinks, args.poll_s, args.idle_timeout_s)}
        finally:
            if sinks is not None:
                sinks.close()

    return run_over_tp(work, pp=pp)[0]


def _configured_pp(root, settings_from_config) -> int:
    """`evaluation.pp` of the newest checkpoint's config (1 before there is one)."""
    steps = sorted((int(d.name), d) for d in root.iterdir() if d.is_dir() and d.name.isdigit())
    try:
        return settings_from_config(steps[-1][1]).pp if steps else 1
    except ValueError:
        return 1  # told again, in one line, when its checkpoint is evaluated


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tasks or args.watch:
        from nanotron_train.eval.harness import offline_by_default

        offline_by_default()  # before the harness or `datasets` is imported
    if args.watch:
        return watch_main(args)
    if not args.ckpt_path:
        print("error: give --ckpt-path CHECKPOINT (or --watch CHECKPOINTS)", file=sys.stderr)
        return 2

    def work(pc) -> dict:
        if args.limit_batches < 0:
            raise ValueError(f"--limit-batches must be >= 0 (0 = all), got {args.limit_batches}")
        if not args.dataset_folder and args.tasks is None:
            raise ValueError("nothing to evaluate: give --dataset-folder DIR and/or --tasks a,b")
        return run(args, pc)

    status, report = run_over_tp(work, pp=args.pp or 1)
    if report is not None:
        if args.json:
            print(json.dumps(report), flush=True)
        else:
            print_report(report)
    return status


if __name__ == "__main__":
    exit_process(main())  # under torchrun too: no teardown after the outcome
