"""`python -m nanotron_train --config-file X.yaml [--override section.key=value ...]`.

Also under torchrun. A user error (bad config, data, layout) prints one line naming the key
and the file, from rank 0 only, and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nanotron_train.config import load_config
from nanotron_train.fault.errors import TrainingStopped
from nanotron_train.fault.launcher import watch_launcher


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m nanotron_train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config-file", required=True, help="the YAML training config")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change one config value (repeatable), e.g. tokens.train_steps=20",
    )
    parser.add_argument(
        "--resume",
        metavar="PATH|latest|auto",
        help="resume from a checkpoint folder, a checkpoints root, or `latest` of "
        "checkpoints_path; `auto`: the latest complete one if there is one, else start fresh "
        "(for torchrun --max-restarts)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    watch_launcher()  # a torchrun worker exits when torchrun dies (fault/launcher.py)
    try:
        overrides = list(args.override)
        if args.resume:  # same as checkpoints.resume_checkpoint_path, quoted so YAML keeps a string
            overrides.append(f"checkpoints.resume_checkpoint_path={json.dumps(args.resume)}")
        cfg = load_config(args.config_file, overrides, world_size=world_size)
        from nanotron_train.metrics import check_optional_sinks
        from nanotron_train.trainer import train

        check_optional_sinks(cfg.logging)  # on every rank, before any process group

        train(cfg)
    except ValueError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except TrainingStopped as exc:  # a policy stopped the run: the same line on every rank
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
