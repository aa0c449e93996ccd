"""Checks for `parallelism.context_parallel_size` (cp): the combinations that cannot work.

Context parallel cuts every sequence into 2*cp chunks (nanotron_parallel.context_parallel),
and under REDUCE_SCATTER each rank's 2 chunks are cut again over tp. checks.py runs these rows
after its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanotron_train.config.rules import Check

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config
KEY = "parallelism.context_parallel_size"


def _sequence_lengths(cfg: Config) -> list[tuple[str, int]]:
    """(key, length) of every sequence length the run trains or evaluates on."""
    out = []
    for i, stage in enumerate(cfg.data_stages):
        if stage.sequence_length is not None:
            out.append((f"data_stages.{i}.sequence_length", stage.sequence_length))
    if len(out) < len(cfg.data_stages) or cfg.validation is not None:
        out.append(("tokens.sequence_length", cfg.tokens.sequence_length))
    return out


def _problem(cfg: Config) -> tuple[str, str] | None:
    """(key, message) of the first sequence length cp (or cp and tp) cannot cut evenly."""
    par = cfg.parallelism
    cp = par.context_parallel_size
    for key, length in _sequence_lengths(cfg) if cp > 1 else ():
        if length % (2 * cp) != 0:
            return key, (
                f"{length} must be divisible by 2*context_parallel_size = {2 * cp} (context "
                "parallel cuts every sequence into 2*cp equal chunks)"
            )
        if par.tp_mode == "REDUCE_SCATTER" and (length // cp) % par.tp != 0:
            return key, (
                f"{length} must be divisible by context_parallel_size * tp = {cp * par.tp} in "
                f"REDUCE_SCATTER mode (each cp rank's {length // cp} tokens are split over tp)"
            )
    return None


CONTEXT_PARALLEL_CHECKS: tuple[Check, ...] = (
    Check(
        KEY,
        lambda c: c.parallelism.context_parallel_size >= 1,
        lambda c: f"must be >= 1, got {c.parallelism.context_parallel_size}",
    ),
    Check(lambda c: _problem(c)[0], lambda c: _problem(c) is None, lambda c: _problem(c)[1]),
)
