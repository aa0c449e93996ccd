"""Checks of the telemetry keys (issue 19): per-rank stats, stragglers, the pipeline timeline,
throughput drops and samples at checkpoints. The keys live in the `logging` section
(config.py); `validate` in config_checks.py calls `validate_telemetry`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from nanotron_train.config.loader import ConfigError

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config

MAX_SAMPLE_PROMPTS = 64  # the dashboard's bound on one `samples` message
MAX_PROMPT_CHARS = 4000
MAX_SAMPLE_NEW_TOKENS = 4096
# The prompts travel in every `samples` message (<= 1 MiB at the dashboard): as JSON they may
# take at most a quarter of it, so the completions keep the rest.
MAX_PROMPTS_JSON_BYTES = 256 << 10


def _check(cond: bool, key: str, message: str, source: str) -> None:
    if not cond:
        raise ConfigError(key, message, source)


def validate_telemetry(cfg: Config, source: str) -> None:
    lg = cfg.logging
    for key in ("rank_stats_interval", "pipeline_timeline_interval"):
        value = getattr(lg, key)
        _check(value >= 0, f"logging.{key}", f"must be >= 0 (0 = off), got {value}", source)
    _check(
        lg.straggler_margin > 0,
        "logging.straggler_margin",
        f"must be > 0 (a fraction above the median), got {lg.straggler_margin}",
        source,
    )
    _check(
        lg.straggler_intervals >= 1,
        "logging.straggler_intervals",
        f"must be >= 1, got {lg.straggler_intervals}",
        source,
    )
    _check(
        0 < lg.throughput_drop_fraction < 1,
        "logging.throughput_drop_fraction",
        f"must be in (0, 1), got {lg.throughput_drop_fraction}",
        source,
    )
    _check(
        1 <= lg.sample_max_new_tokens <= MAX_SAMPLE_NEW_TOKENS,
        "logging.sample_max_new_tokens",
        f"must be in [1, {MAX_SAMPLE_NEW_TOKENS}], got {lg.sample_max_new_tokens}",
        source,
    )
    prompts = lg.sample_prompts
    if not prompts:
        return
    key = "logging.sample_prompts"
    _check(
        len(prompts) <= MAX_SAMPLE_PROMPTS,
        key,
        f"at most {MAX_SAMPLE_PROMPTS} prompts, got {len(prompts)}",
        source,
    )
    for i, prompt in enumerate(prompts):
        _check(
            0 < len(prompt) <= MAX_PROMPT_CHARS,
            f"{key}.{i}",
            f"must have 1 to {MAX_PROMPT_CHARS} characters, got {len(prompt)}",
            source,
        )
    size = len(json.dumps(list(prompts)))
    _check(
        size <= MAX_PROMPTS_JSON_BYTES,
        key,
        f"the prompts take {size} bytes as JSON, over the {MAX_PROMPTS_JSON_BYTES}-byte limit "
        "(they travel in every samples message)",
        source,
    )
    _check(
        bool(cfg.tokenizer.tokenizer_name_or_path),
        key,
        "needs tokenizer.tokenizer_name_or_path (the prompts are encoded with it)",
        source,
    )
    _check(
        bool(cfg.checkpoints.checkpoints_path) and cfg.checkpoints.checkpoint_interval > 0,
        key,
        "samples are made at each checkpoint: set checkpoints.checkpoints_path and "
        "checkpoints.checkpoint_interval",
        source,
    )
