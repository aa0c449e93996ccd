"""The rows of the config check tables: a key, a predicate on the config, a message.

`Check` and the builders of its common rows (`at_least`, `positive`, `below_one`, `refused`),
shared by config_checks.py (combinations) and config_values.py (ranges of single values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    key: str
    holds: Callable[..., bool]  # (cfg) or, in STAGE_CHECKS, (cfg, stage)
    message: Callable[..., str] | str


def value(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def at_least(path: str, low: float, nullable: bool = False, strict: bool = False) -> Check:
    """value >= low (> low when strict); null allowed when nullable."""

    def holds(c) -> bool:
        v = value(c, path)
        return (nullable and v is None) or (v is not None and (v > low if strict else v >= low))

    bound = f"{'>' if strict else '>='} {low}{' or null' if nullable else ''}"
    return Check(path, holds, lambda c: f"must be {bound}, got {value(c, path)}")


def positive(path: str, nullable: bool = False) -> Check:
    return at_least(path, 0, nullable, strict=True)


def below_one(path: str) -> Check:
    """An Adam beta: in [0, 1) (or null: the default)."""
    return Check(
        path,
        lambda c: value(c, path) is None or 0 <= value(c, path) < 1,
        lambda c: f"must be in [0, 1), got {value(c, path)}",
    )


def refused(path: str, allowed: Callable[[Any], bool], feature: str) -> Check:
    """A key whose value asks for a Nanotron feature this project does not have."""
    return Check(
        path,
        lambda c: allowed(value(c, path)),
        lambda c: f"{value(c, path)!r} asks for {feature}, which this project does not have",
    )
