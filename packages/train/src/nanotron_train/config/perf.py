"""Checks of the memory-and-speed keys: recompute, async TP, the interleaved engine, compile and
the `profiler` section (schema.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanotron_parallel.pipeline import ENGINES, PipelineEngine
from nanotron_train.config.rules import Check, at_least

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config


def _engine(cfg: Config) -> PipelineEngine:
    return ENGINES[cfg.parallelism.pp_engine]


_VIRTUAL = ", ".join(name for name, e in ENGINES.items() if e.uses_virtual_stages)


def _profiler_row(row: Check) -> Check:
    """A row of the optional `profiler` section: it holds when the section is absent."""
    return Check(row.key, lambda c: c.profiler is None or row.holds(c), row.message)


PERF_CHECKS: tuple[Check, ...] = (
    at_least("parallelism.pp_virtual_stages", 1),
    Check(
        "parallelism.pp_virtual_stages",
        lambda c: _engine(c).uses_virtual_stages or c.parallelism.pp_virtual_stages == 1,
        lambda c: (
            f"is {c.parallelism.pp_virtual_stages} but only parallelism.pp_engine: "
            f"{_VIRTUAL} uses virtual stages"
        ),
    ),
    Check(
        "tokens.batch_accumulation_per_replica",
        lambda c: (
            not _engine(c).micro_batches_multiple_of_pp
            or c.tokens.batch_accumulation_per_replica % c.parallelism.pp == 0
        ),
        lambda c: (
            f"the {c.parallelism.pp_engine} engine needs the micro-batches per step "
            f"({c.tokens.batch_accumulation_per_replica}) to be divisible by "
            f"parallelism.pp={c.parallelism.pp}"
        ),
    ),
    Check(
        "parallelism.pp_virtual_stages",
        lambda c: (
            not _engine(c).uses_virtual_stages
            or c.model.model_config.num_hidden_layers
            >= c.parallelism.pp * c.parallelism.pp_virtual_stages
        ),
        lambda c: (
            f"pp * pp_virtual_stages = {c.parallelism.pp} * {c.parallelism.pp_virtual_stages} = "
            f"{c.parallelism.pp * c.parallelism.pp_virtual_stages} virtual stages need at least "
            "as many decoder layers, but model.model_config.num_hidden_layers="
            f"{c.model.model_config.num_hidden_layers}"
        ),
    ),
    Check(
        "parallelism.pp",
        lambda c: (
            not _engine(c).fixed_chunks
            or c.model.model_config.num_hidden_layers >= c.parallelism.pp * _engine(c).fixed_chunks
        ),
        lambda c: (
            f"{c.parallelism.pp} with pp_engine {c.parallelism.pp_engine}: its "
            f"{_engine(c).fixed_chunks} chunks per rank make "
            f"{c.parallelism.pp * _engine(c).fixed_chunks} virtual stages, more than "
            f"model.model_config.num_hidden_layers={c.model.model_config.num_hidden_layers}"
        ),
    ),
    *(
        _profiler_row(at_least(f"profiler.{name}", 0))
        for name in ("wait", "warmup", "repeat", "skip_first")
    ),
    _profiler_row(at_least("profiler.active", 1)),
    _profiler_row(
        Check(
            "profiler.profiler_export_path",
            lambda c: bool(c.profiler.profiler_export_path),
            "must be a folder path",
        )
    ),
)
