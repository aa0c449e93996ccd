"""Command line of the checkpoints package (errors: one line, exit status 2)."""

from __future__ import annotations

import argparse
import sys

from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.listing import list_checkpoints, to_json, to_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron_train.checkpoints")
    sub = parser.add_subparsers(dest="command", required=True)
    lst = sub.add_parser(
        "list", help="each checkpoint: step, tokens, topology, size, complete or not"
    )
    lst.add_argument("path", help="the checkpoints folder (checkpoints.checkpoints_path)")
    lst.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        entries = list_checkpoints(args.path)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(to_json(entries) if args.json else to_table(entries))
    return 0
