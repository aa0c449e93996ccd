"""Checks for `parallelism.expert_parallel_size` (ep): the layouts expert parallelism can run.

ep splits the data-parallel ranks (nanotron_parallel.grid: dp = edp x ep), so it must divide
dp and is not a factor of the world size; each ep rank holds num_experts / ep experts of every
MoE layer, so it must divide num_experts; and it needs a model with experts. checks.py runs
these rows after its own (the model's `moe_config` is checked there first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanotron_train.config.rules import Check, at_least

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config

KEY = "parallelism.expert_parallel_size"


def moe_config(cfg: Config):
    """The model's `moe_config`, or None for a dense model."""
    return getattr(cfg.model.model_config, "moe_config", None)


def _ep(cfg: Config) -> int:
    return cfg.parallelism.expert_parallel_size


MOE_CHECKS: tuple[Check, ...] = (
    at_least(KEY, 1),
    Check(
        KEY,
        lambda c: _ep(c) == 1 or moe_config(c) is not None,
        lambda c: (
            f"{_ep(c)} needs a mixture-of-experts model (model.model_config.moe_config): "
            "expert parallelism splits the experts"
        ),
    ),
    Check(
        KEY,
        lambda c: moe_config(c) is None or moe_config(c).num_experts % _ep(c) == 0,
        lambda c: (
            f"{_ep(c)} must divide model.model_config.moe_config.num_experts="
            f"{moe_config(c).num_experts} (each ep rank holds num_experts / ep experts)"
        ),
    ),
    Check(
        KEY,
        lambda c: c.parallelism.dp % _ep(c) == 0,
        lambda c: (
            f"{_ep(c)} must divide parallelism.dp={c.parallelism.dp}: expert-parallel ranks "
            "are data-parallel ranks (each sees its own tokens), so ep lives inside dp"
        ),
    ),
)
