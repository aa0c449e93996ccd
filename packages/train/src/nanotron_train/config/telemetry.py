"""Checks of the telemetry keys: per-rank stats, stragglers, the pipeline timeline, throughput
drops and samples at checkpoints (keys of the `logging` section, schema.py), and the
`metrics_logging` section's per-layer statistics."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from nanotron_train.config.rules import Check, at_least

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config
MAX_SAMPLE_PROMPTS = 64  # the dashboard's bound on one `samples` message
MAX_PROMPT_CHARS = 4000
MAX_SAMPLE_NEW_TOKENS = 4096
# The prompts travel in every `samples` message (<= 1 MiB at the dashboard): as JSON they may
# take at most a quarter of it, so the completions keep the rest.
MAX_PROMPTS_JSON_BYTES = 256 << 10
PROMPTS = "logging.sample_prompts"


def _bad_prompt(cfg: Config) -> int | None:
    """The index of the first prompt too short or too long."""
    prompts = cfg.logging.sample_prompts
    return next((i for i, p in enumerate(prompts) if not 0 < len(p) <= MAX_PROMPT_CHARS), None)


def _prompts_bytes(cfg: Config) -> int:
    return len(json.dumps(list(cfg.logging.sample_prompts)))


def _prompts_row(key, holds, message) -> Check:
    """A row about the sample prompts: it holds when there are none."""
    return Check(key, lambda c: not c.logging.sample_prompts or holds(c), message)


def _off_or_interval(key: str) -> Check:
    return Check(
        key,
        lambda c: getattr(c.logging, key.split(".")[1]) >= 0,
        lambda c: f"must be >= 0 (0 = off), got {getattr(c.logging, key.split('.')[1])}",
    )


TELEMETRY_CHECKS: tuple[Check, ...] = (
    Check(  # Nanotron's values: 0 basic, 1 full
        "metrics_logging.log_level",
        lambda c: c.metrics_logging is None or c.metrics_logging.log_level in (0, 1),
        lambda c: (
            f"must be 0 (basic) or 1 (per-layer statistics), got {c.metrics_logging.log_level}"
        ),
    ),
    Check(
        "metrics_logging.log_detail_interval",
        lambda c: c.metrics_logging is None or c.metrics_logging.log_detail_interval >= 1,
        lambda c: f"must be >= 1, got {c.metrics_logging.log_detail_interval}",
    ),
    _off_or_interval("logging.rank_stats_interval"),
    _off_or_interval("logging.pipeline_timeline_interval"),
    Check(
        "logging.straggler_margin",
        lambda c: c.logging.straggler_margin > 0,
        lambda c: f"must be > 0 (a fraction above the median), got {c.logging.straggler_margin}",
    ),
    at_least("logging.straggler_intervals", 1),
    Check(
        "logging.throughput_drop_fraction",
        lambda c: 0 < c.logging.throughput_drop_fraction < 1,
        lambda c: f"must be in (0, 1), got {c.logging.throughput_drop_fraction}",
    ),
    Check(
        "logging.sample_max_new_tokens",
        lambda c: 1 <= c.logging.sample_max_new_tokens <= MAX_SAMPLE_NEW_TOKENS,
        lambda c: f"must be in [1, {MAX_SAMPLE_NEW_TOKENS}], got {c.logging.sample_max_new_tokens}",
    ),
    _prompts_row(
        PROMPTS,
        lambda c: len(c.logging.sample_prompts) <= MAX_SAMPLE_PROMPTS,
        lambda c: f"at most {MAX_SAMPLE_PROMPTS} prompts, got {len(c.logging.sample_prompts)}",
    ),
    _prompts_row(
        lambda c: f"{PROMPTS}.{_bad_prompt(c)}",
        lambda c: _bad_prompt(c) is None,
        lambda c: (
            f"must have 1 to {MAX_PROMPT_CHARS} characters, got "
            f"{len(c.logging.sample_prompts[_bad_prompt(c)])}"
        ),
    ),
    _prompts_row(
        PROMPTS,
        lambda c: _prompts_bytes(c) <= MAX_PROMPTS_JSON_BYTES,
        lambda c: (
            f"the prompts take {_prompts_bytes(c)} bytes as JSON, over the "
            f"{MAX_PROMPTS_JSON_BYTES}-byte limit (they travel in every samples message)"
        ),
    ),
    _prompts_row(
        PROMPTS,
        lambda c: bool(c.tokenizer.tokenizer_name_or_path),
        "needs tokenizer.tokenizer_name_or_path (the prompts are encoded with it)",
    ),
    _prompts_row(
        PROMPTS,
        lambda c: bool(c.checkpoints.checkpoints_path) and c.checkpoints.checkpoint_interval > 0,
        "samples are made at each checkpoint: set checkpoints.checkpoints_path and "
        "checkpoints.checkpoint_interval",
    ),
)
