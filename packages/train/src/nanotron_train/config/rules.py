"""The rows of the config check tables: a key, a predicate on the config, a message.

Every section's checks are tables of `Check` rows (checks.py and the modules it gathers), run
by `run_checks`: the first row that does not hold is one ConfigError naming its key and the
file. Here too are the builders of the common rows (`at_least`, `positive`, `below_one`,
`refused`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanotron_train.config.errors import ConfigError


@dataclass(frozen=True)
class Check:
    # The dotted key the error names; or a function of the same arguments as `holds` giving
    # it, for rows over a list (the failing item's key). `{i}` is the index of run_checks.
    key: str | Callable[..., str]
    holds: Callable[..., bool]  # (cfg) or, in STAGE_CHECKS, (cfg, stage)
    message: Callable[..., str] | str


def run_checks(rows: tuple[Check, ...], source: str, *args: Any, index: int = 0) -> None:
    """Raise a ConfigError for the first row of `rows` that does not hold for `args`."""
    for row in rows:
        if not row.holds(*args):
            key = row.key(*args) if callable(row.key) else row.key
            message = row.message if isinstance(row.message, str) else row.message(*args)
            raise ConfigError(key.replace("{i}", str(index)), message, source)


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
