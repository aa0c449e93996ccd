"""Checks for `parallelism.context_parallel_size` (cp) and `parallelism.cp_attention`: the
combinations that cannot work, and which attention a config asks for.

Context parallel cuts every sequence into 2*cp chunks (nanotron_parallel.context_parallel),
and under REDUCE_SCATTER each rank's 2 chunks are cut again over tp. Ulysses splits the query
heads of each tp rank over cp. checks.py runs these rows after its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanotron_train.config.rules import Check

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config
KEY = "parallelism.context_parallel_size"
ATTENTION_KEY = "parallelism.cp_attention"


def cp_attention(par, model_config) -> str:
    """The context-parallel attention a config asks for: `parallelism.cp_attention`, or when
    that is null, Nanotron's `_attn_implementation: llama3_ring_attention` -> ring, else the
    all-gather."""
    if par.cp_attention is not None:
        return par.cp_attention
    ring = getattr(model_config, "_attn_implementation", None) == "llama3_ring_attention"
    return "ring" if ring else "allgather"


def _ulysses_heads_ok(cfg: Config) -> bool:
    par = cfg.parallelism
    if par.context_parallel_size == 1 or cp_attention(par, cfg.model.model_config) != "ulysses":
        return True  # (a family without attention heads never gets here with ulysses)
    heads = cfg.model.model_config.num_attention_heads
    return heads % (par.context_parallel_size * par.tp) == 0


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
    Check(
        ATTENTION_KEY,
        _ulysses_heads_ok,
        lambda c: (
            f"ulysses splits the attention heads over context_parallel_size * tp = "
            f"{c.parallelism.context_parallel_size * c.parallelism.tp}, which must divide "
            f"num_attention_heads = {c.model.model_config.num_attention_heads}"
        ),
    ),
)
