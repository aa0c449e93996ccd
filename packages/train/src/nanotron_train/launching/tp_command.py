"""The launch of the checkpoint commands (generate, evaluate): one tensor-parallel group of every
process the launch started (torchrun or a plain `python -m`; generate may split them into
pipeline stages of tp groups), no gradients, and the project's
rule for user errors: a ValueError is one line (once per node under torchrun, whichever rank
stops first: first_report.py) and exit status 2."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


def run_over_tp(
    work: Callable[[Any], dict[str, Any]], tp: int | None = None, pp: int = 1
) -> tuple[int, dict[str, Any] | None]:
    """Run `work(pc)` on a ParallelContext of dp = 1, `pp` stages and tp = the launch's world
    size / pp.

    `tp`, when the user gave one, must equal that. Returns the exit status and, on rank 0 of a
    successful run, `work`'s report (None elsewhere).
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pc = None
    try:
        if pp < 1 or world % pp:
            raise ValueError(
                f"--pp {pp} must divide the number of processes ({world}): launch with "
                f"torchrun --nproc_per_node=<a multiple of {max(pp, 1)}>"
            )
        if tp is not None and tp * pp != world:
            raise ValueError(
                f"--tp {tp} times --pp {pp} must equal the number of processes ({world}): "
                f"launch with torchrun --nproc_per_node={tp * pp}"
            )
        from nanotron_parallel.context import ParallelContext

        pc = ParallelContext(dp=1, tp=world // pp, pp=pp)
        with torch.no_grad():
            report = work(pc)
    except ValueError as exc:
        from nanotron_train.launching.first_report import report_first

        report_first(f"error: {exc}")
        return 2, None
    except KeyboardInterrupt:
        return 130, None
    finally:
        if pc is not None:
            pc.destroy()
    return 0, report if rank == 0 else None
