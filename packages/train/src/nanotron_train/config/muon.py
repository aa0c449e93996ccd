"""Checks for `optimizer.optimizer_factory.name: muon` and its `muon_*` keys (checks.py runs
these rows after its own)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from nanotron_train.config.rules import Check, at_least, below_one, positive

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config

KEY = "optimizer.optimizer_factory"
MAX_NS_STEPS = 99  # torch.optim.Muon refuses 100 or more


def _muon_keys_given(cfg: Config) -> list[str]:
    f = cfg.optimizer.optimizer_factory
    return [
        x.name for x in fields(f) if x.name.startswith("muon_") and getattr(f, x.name) is not None
    ]


def _factory(c: Config):
    return c.optimizer.optimizer_factory


MUON_CHECKS: tuple[Check, ...] = (
    Check(
        KEY,
        lambda c: _factory(c).name == "muon" or not _muon_keys_given(c),
        lambda c: f"{', '.join(_muon_keys_given(c))} apply only with name: muon",
    ),
    positive(f"{KEY}.muon_learning_rate", nullable=True),
    at_least(f"{KEY}.muon_weight_decay", 0, nullable=True),
    below_one(f"{KEY}.muon_momentum"),
    Check(
        f"{KEY}.muon_ns_steps",
        lambda c: (
            _factory(c).muon_ns_steps is None or 1 <= _factory(c).muon_ns_steps <= MAX_NS_STEPS
        ),
        lambda c: f"must be in [1, {MAX_NS_STEPS}], got {_factory(c).muon_ns_steps}",
    ),
    Check(
        f"{KEY}.muon_ns_coefficients",
        lambda c: (
            _factory(c).muon_ns_coefficients is None or len(_factory(c).muon_ns_coefficients) == 3
        ),
        lambda c: f"must be 3 numbers [a, b, c], got {_factory(c).muon_ns_coefficients}",
    ),
    positive(f"{KEY}.muon_eps", nullable=True),
)
