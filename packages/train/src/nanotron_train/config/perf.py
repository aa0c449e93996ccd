"""Config pieces of the memory-and-speed features: the profiler section and their checks.

Kept out of config.py so that file stays about Nanotron's core sections; `validate` there calls
`validate_perf` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanotron_train.config.loader import ConfigError

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config

PP_ENGINES = ("afab", "1f1b", "interleaved-1f1b")


@dataclass
class ProfilerArgs:
    """Nanotron's `profiler` section: torch.profiler over the steps chosen by the schedule
    (skip `wait` steps, `warmup` steps traced but discarded, then `active` steps recorded,
    `repeat` times; 0 = until the end)."""

    profiler_export_path: str = "profiler"
    wait: int = 1
    warmup: int = 1
    active: int = 1
    repeat: int = 1
    skip_first: int = 3  # Nanotron's defaults
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = True
    export_chrome_trace: bool = False


def _check(cond: bool, key: str, message: str, source: str) -> None:
    if not cond:
        raise ConfigError(key, message, source)


def validate_perf(cfg: Config, source: str) -> None:
    """Checks for recompute, async TP, the interleaved engine, compile and the profiler."""
    par, tok = cfg.parallelism, cfg.tokens
    v = par.pp_virtual_stages
    _check(v >= 1, "parallelism.pp_virtual_stages", f"must be >= 1, got {v}", source)
    if par.pp_engine != "interleaved-1f1b":
        _check(
            v == 1,
            "parallelism.pp_virtual_stages",
            f"is {v} but only parallelism.pp_engine: interleaved-1f1b uses virtual stages",
            source,
        )
    else:
        m = tok.batch_accumulation_per_replica
        _check(
            m % par.pp == 0,
            "tokens.batch_accumulation_per_replica",
            f"the interleaved-1f1b engine needs the micro-batches per step ({m}) to be "
            f"divisible by parallelism.pp={par.pp}",
            source,
        )
        layers = cfg.model.model_config.num_hidden_layers
        _check(
            layers >= par.pp * v,
            "parallelism.pp_virtual_stages",
            f"pp * pp_virtual_stages = {par.pp} * {v} = {par.pp * v} virtual stages need at "
            f"least as many decoder layers, but model.model_config.num_hidden_layers={layers}",
            source,
        )
    prof = cfg.profiler
    if prof is not None:
        for name in ("wait", "warmup", "repeat", "skip_first"):
            value = getattr(prof, name)
            _check(value >= 0, f"profiler.{name}", f"must be >= 0, got {value}", source)
        _check(prof.active >= 1, "profiler.active", f"must be >= 1, got {prof.active}", source)
        _check(
            bool(prof.profiler_export_path),
            "profiler.profiler_export_path",
            "must be a folder path",
            source,
        )
