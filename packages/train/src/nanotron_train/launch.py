"""`python -m nanotron_train.launch [torchrun options] --config-file C.yaml [--override ...]`

torchrun with the trainer's promise kept: a user error (config, data, checkpoint) is one line
and exit status 2. Plain `torchrun -m nanotron_train` prints that line too, but its elastic
agent then adds a `ChildFailedError` report and exits with 1. This launcher checks the config
(with the world size torchrun will make) before starting any process, then runs torchrun's
own `run`. A worker that stops on a user error writes its line to torchrun's error file
(TORCHELASTIC_ERROR_FILE) instead of printing it; when the first worker to fail did so, the
launcher prints that line and exits with 2, nothing more. A crash keeps torchrun's report.
SIGTERM or SIGUSR1 (a batch scheduler's preemption) is passed to the workers, which save and
exit 0; so does the launch (fault/forward_signals.py). Plain torchrun exits 1 there.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from nanotron_train.__main__ import QUIET_ENV, add_trainer_args, overrides_of, source_of
from nanotron_train.fault.forward_signals import SignalForwarder


def _world_size(args: argparse.Namespace) -> int | None:
    """nproc_per_node x nnodes when both are plain numbers (elastic ranges: not known yet)."""
    low, _, high = str(args.nnodes).partition(":")
    try:
        if high and int(high) != int(low):
            return None
        return int(args.nproc_per_node) * int(low)
    except ValueError:  # "gpu", "auto", ...
        return None


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _auto_layout(cfg, args: argparse.Namespace, source: str):
    """parallelism: auto: choose and print the layout before starting any worker (each worker
    chooses the same again); nothing fitting is the one-line error. An elastic world size is
    not known here: the workers choose."""
    from nanotron_train.plan.auto import SHOWN_ENV, resolve

    world = _world_size(args)
    if world is None:
        return cfg
    per_node = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else world
    cfg, block = resolve(cfg, world, per_node, source)
    if block:
        print(block, flush=True)
        os.environ[SHOWN_ENV] = "1"  # the workers' rank 0 does not print it again
    return cfg


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from nanotron_train.config.load import load_config
    from nanotron_train.config.training_inputs import prepare_for_training

    ours = argparse.ArgumentParser(add_help=False)
    add_trainer_args(ours)
    mine, torchrun_args = ours.parse_known_args(argv)
    forwarded = ["--config-file", mine.config_file]
    for assignment in mine.override:
        forwarded += ["--override", assignment]
    if mine.resume:
        forwarded += ["--resume", mine.resume]
    if mine.auto:  # the workers choose the same layout (plan/auto.py): printed here once
        forwarded.append("--auto")
    args = get_args_parser().parse_args([*torchrun_args, "-m", "nanotron_train", *forwarded])
    try:
        source = source_of(mine)
        cfg = load_config(mine.config_file, overrides_of(mine), _world_size(args), source)
        cfg = _auto_layout(cfg, args, source)
        prepare_for_training(cfg, source, warn=_print)  # data
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    # The workers report a user error through torchrun's error file (no printing): the
    # first one to fail is the cause, the others are stopped by the agent.
    os.environ[QUIET_ENV] = "1"
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):  # its report duplicates ours
            logging.getLogger(name).setLevel(logging.CRITICAL)
    SignalForwarder(args)  # SIGTERM/SIGUSR1: the workers save and exit 0, and so do we
    try:
        run(args)
    except SignalException as exc:  # a signal before any worker started
        print(f"error: stopped by {exc}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()
        if first.exitcode == 2:  # a user error: its one line
            print(first.message, file=sys.stderr, flush=True)
            return 2
        print(f"error: {exc.format_msg()}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
