"""`python -m nanotron_train --config-file X.yaml [--override section.key=value ...]`.

Also under torchrun. A user error (bad config, data, layout) prints one line naming the key
and the file, once per node whichever rank stops first (launching/first_report.py), and exits
with status 2; no traceback. (torchrun itself then reports the failure and exits with 1:
`python -m nanotron_train.launch` does not.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from nanotron_train.config.load import load_config
from nanotron_train.config.training_inputs import prepare_for_training
from nanotron_train.fault.errors import TrainingStopped
from nanotron_train.fault.launcher import watch_launcher
from nanotron_train.launching.first_report import report_first
from nanotron_train.process_exit import exit_process


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m nanotron_train", description=__doc__.split("\n")[0]
    )
    add_trainer_args(parser)
    return parser.parse_args(argv)


def overrides_of(args: argparse.Namespace) -> list[str]:
    """--override values, and --resume as checkpoints.resume_checkpoint_path."""
    overrides = list(args.override)
    if getattr(args, "auto", False):  # after the user's: --auto wins over parallelism keys
        overrides.append("parallelism.auto=true")
    if args.resume:  # quoted so that YAML keeps a string
        overrides.append(f"checkpoints.resume_checkpoint_path={json.dumps(args.resume)}")
    return overrides


def source_of(args: argparse.Namespace) -> str:
    """The config's name in a run's errors and warnings: its file and the flags given."""
    from nanotron_train.config.training_inputs import config_source

    given = (("--override", args.override), ("--auto", getattr(args, "auto", False)),
             ("--resume", args.resume))  # fmt: skip
    return config_source(args.config_file, [flag for flag, value in given if value])


def add_trainer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-file", required=True, help="the YAML training config")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change one config value (repeatable), e.g. tokens.train_steps=20",
    )
    parser.add_argument(
        "--auto",
        action="store_true",
        help="train with the layout planner's best fitting layout for the world size "
        "(as parallelism: auto): dp/tp/pp/cp/ep, ZeRO stage, micro-batch size, recompute",
    )
    parser.add_argument(
        "--resume",
        metavar="PATH|latest|auto",
        help="resume from a checkpoint folder, a checkpoints root, or `latest` of "
        "checkpoints_path; `auto`: the latest complete one if there is one, else start fresh "
        "(for torchrun --max-restarts)",
    )


QUIET_ENV = "NANOTRON_LAUNCHER"  # set by nanotron_train.launch for its workers


def _report(line: str) -> None:
    """The first rank of the node to fail prints the line (first_report.py); under
    nanotron_train.launch every rank hands it to the launcher in torchrun's error file instead
    (the first to fail is the one shown)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get(QUIET_ENV) and error_file:
        with open(error_file, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    else:
        report_first(line)


def _warner(rank: int) -> Callable[[str], None] | None:
    """Where a config warning goes: stderr of rank 0, or nowhere under nanotron_train.launch
    (which printed it before starting the workers)."""
    if rank != 0 or os.environ.get(QUIET_ENV):
        return None
    return lambda line: print(line, file=sys.stderr, flush=True)


def _auto_layout(cfg, world_size: int, source: str, rank: int):
    """parallelism: auto: the planner's layout; rank 0 prints why (unless
    nanotron_train.launch printed it before starting the workers)."""
    from nanotron_train.plan.auto import SHOWN_ENV, resolve

    cfg, block = resolve(cfg, world_size, source=source)
    if block and rank == 0 and not os.environ.get(SHOWN_ENV):
        print(block, flush=True)
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    watch_launcher()  # a torchrun worker exits when torchrun dies (fault/launcher.py)
    try:
        source = source_of(args)
        cfg = load_config(args.config_file, overrides_of(args), world_size, source)
        cfg = _auto_layout(cfg, world_size, source, rank)
        cfg = prepare_for_training(cfg, source, _warner(rank))
        from nanotron_train.reporting.metrics import check_optional_sinks
        from nanotron_train.trainer import train

        check_optional_sinks(cfg.logging)  # on every rank, before any process group

        train(cfg)
    except ValueError as exc:
        _report(f"error: {exc}")
        return 2
    except TrainingStopped as exc:  # a policy stopped the run: the same line on every rank
        report_first(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    exit_process(main())  # the status is the outcome: no teardown after it (process_exit.py)
