"""Single values a config must hold, whatever the combination: checked before checks.py's rows.

1. Every number, found by walking the typed config once (dataclass fields, lists, mappings
   such as model_config.rope_scaling): a float must be finite (`.nan`, `.inf` are YAML floats
   that would otherwise surface hours later as a non-finite loss), an integer must fit in 64
   bits (torch, NumPy and the checkpoint files hold them as int64).
2. `RANGES`: the rows for values whose range no other check states (seeds, where torch and
   NumPy refuse negative or too large ones with a traceback; the final learning rate).
3. Paths the trainer writes to must be of the right kind: a file key that names a folder (or
   a folder key that names a file) would fail only at the first write.
All three are rows of `VALUE_CHECKS`; each failure is one ConfigError naming the dotted key and
the file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotron_train.config.rules import Check, at_least, value

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _numbers(obj: Any, key: str) -> Iterator[tuple[str, int | float]]:
    """(dotted key, number) of every int and float under `obj`."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, int | float):
        yield key, obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _numbers(getattr(obj, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{key}.{i}")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{key}.{k}")


def number_error(number: int | float) -> str | None:
    if isinstance(number, float) and not math.isfinite(number):
        return f"must be a finite number, got {number}"
    if isinstance(number, int) and not INT64_MIN <= number <= INT64_MAX:
        return f"must fit in 64 bits (at most 2**63-1), got {number}"
    return None


def within(path: str, low: int, high: int, why: str) -> Check:
    def holds(c) -> bool:
        return low <= value(c, path) <= high

    return Check(path, holds, lambda c: f"must be in [{low}, {high}] ({why}), got {value(c, path)}")


RANGES: tuple[Check, ...] = (
    within("general.seed", 0, INT64_MAX, "a 64-bit seed for torch, NumPy and random"),
    at_least("optimizer.learning_rate_scheduler.min_decay_lr", 0, nullable=True),
)
SEED32 = 2**32 - 1  # a data stage's seed: NumPy's RandomState (file shuffles) takes no more

# (key, what it must be when it exists): files the trainer appends to, folders it writes into.
PATHS = (
    ("logging.metrics_file", "file"),
    ("general.benchmark_csv_path", "file"),
    ("logging.tensorboard_dir", "folder"),
    ("checkpoints.checkpoints_path", "folder"),
)


def path_error(path: str | None, kind: str) -> str | None:
    if not path or "://" in path:
        return None
    p = Path(path)
    if kind == "file" and p.is_dir():
        return f"{path} is a folder; give the path of a file (created if missing)"
    if kind == "file" and p.parent.exists() and not p.parent.is_dir():
        return f"{p.parent} is not a folder"
    if kind == "folder" and p.exists() and not p.is_dir():
        return f"{path} is a file; give a folder (created if missing)"
    return None


def _bad_number(cfg: Config) -> tuple[str, str] | None:
    """(key, error) of the first number that no tensor or file could hold."""
    return next(((k, e) for k, n in _numbers(cfg, "") if (e := number_error(n))), None)


def _bad_seed(cfg: Config) -> int | None:
    return next((i for i, s in enumerate(cfg.data_stages) if not 0 <= s.data.seed <= SEED32), None)


def _path_check(key: str, kind: str) -> Check:
    return Check(
        key,
        lambda c: path_error(value(c, key), kind) is None,
        lambda c: path_error(value(c, key), kind),
    )


VALUE_CHECKS: tuple[Check, ...] = (
    Check(
        lambda c: _bad_number(c)[0],
        lambda c: _bad_number(c) is None,
        lambda c: _bad_number(c)[1],
    ),
    *RANGES,
    Check(
        lambda c: f"data_stages.{_bad_seed(c)}.data.seed",
        lambda c: _bad_seed(c) is None,
        lambda c: (
            f"must be in [0, {SEED32}] (NumPy's seed range), got "
            f"{c.data_stages[_bad_seed(c)].data.seed}"
        ),
    ),
    *(_path_check(key, kind) for key, kind in PATHS),
)
