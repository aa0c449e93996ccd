"""Nanotron's `logging.log_level` (rank 0) and `log_level_replica` (every other rank).

Our packages log through Python's `logging` under the names nanotron_train, nanotron_models
and nanotron_parallel. Each rank sets their level and, once, a stderr handler that prefixes the
rank; `passive` leaves Python's logging configuration alone (Nanotron's meaning). Rank 0's
per-step lines are info: a level above info leaves them out of stdout (the metrics file, the
dashboard and TensorBoard still get every record).
"""

from __future__ import annotations

import logging
import sys

PACKAGES = ("nanotron_train", "nanotron_models", "nanotron_parallel")
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class _RankHandler(logging.StreamHandler):
    """Ours: recognised so that a second Trainer in the same process does not add another."""


def configure_logging(logging_args, rank: int) -> str:
    """Apply this rank's level; returns its name ("passive" when left alone)."""
    name = logging_args.log_level if rank == 0 else logging_args.log_level_replica
    if name == "passive":
        return name
    for package in PACKAGES:
        logger = logging.getLogger(package)
        logger.setLevel(LEVELS[name])
        for handler in [h for h in logger.handlers if isinstance(h, _RankHandler)]:
            logger.removeHandler(handler)
        handler = _RankHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        )
        logger.addHandler(handler)  # records still propagate (pytest's caplog, user handlers)
    return name


def prints_step_lines(level_name: str) -> bool:
    return level_name in ("passive", "debug", "info")
