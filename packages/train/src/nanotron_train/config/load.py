"""Reading a config: YAML file -> `--override`s -> typed dataclasses (schema.py) -> checks.

`load_config(path, overrides, world_size)` reads, applies `--override section.key=value`,
type-checks every key (unknown key, wrong type, missing value = ConfigError naming the key and
the file) and runs the tables of checks.py (combinations, refused Nanotron features). It needs
no process group, so every rank runs it before anything distributed starts. `save_config`
writes a config back, loadable again.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import yaml

from nanotron_train.config.checks import validate
from nanotron_train.config.errors import ConfigError
from nanotron_train.config.loader import apply_override, from_dict
from nanotron_train.config.nanotron_layouts import INIT_CHECKS, upgrade_optimizer_layout
from nanotron_train.config.rules import run_checks
from nanotron_train.config.schema import Config


def expand_run_name(run: str | None, now: datetime.datetime | None = None) -> str:
    """Nanotron's run-name templates: %date (YYYYmmdd_HHMMSS) and %jobid (SLURM_JOB_ID or
    "local"); a missing name is "%date_%jobid"."""
    name = "%date_%jobid" if run is None else run
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d_%H%M%S")
    return name.replace("%date", stamp).replace("%jobid", os.environ.get("SLURM_JOB_ID", "local"))


def config_from_dict(
    data: dict[str, Any], source: str = "<config>", world_size: int | None = None
) -> Config:
    """Typed config from a raw mapping, validated (world size checked when given)."""
    data = _auto_layout(data)
    data = upgrade_optimizer_layout(_token_ids_default_to_the_tokenizers(data), source)
    cfg = from_dict(Config, data, "", source)
    cfg.general.run = expand_run_name(cfg.general.run)
    validate(cfg, source, world_size)
    run_checks(INIT_CHECKS, source, cfg)
    return cfg


def _auto_layout(data: dict[str, Any]) -> dict[str, Any]:
    """`parallelism: auto` is `parallelism: {auto: true}` (ours: plan/auto.py chooses the
    layout); any other string is left to the type check's one line."""
    if isinstance(data.get("parallelism"), str) and data["parallelism"].lower() == "auto":
        return {**data, "parallelism": {"auto": True}}
    return data


def _token_ids_default_to_the_tokenizers(data: dict[str, Any]) -> dict[str, Any]:
    """A bos/eos_token_id left out of model_config means the tokenizer's (null), not the model
    classes' defaults (Nanotron's 1 and 2, ordinary tokens of most tokenizers: token_ids.py)."""
    model = data.get("model")
    mc = model.get("model_config") if isinstance(model, dict) else None
    if not isinstance(mc, dict):
        return data
    ids = {"bos_token_id": None, "eos_token_id": None}
    return {**data, "model": {**model, "model_config": {**ids, **mc}}}


def load_config(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    world_size: int | None = None,
    source: str | None = None,
) -> Config:
    """Read a YAML config file, apply `section.key=value` overrides, type-check and validate.
    `source`: the config's name in errors once overrides are applied (a command line names
    the flags it was given: training_inputs.config_source); by default the file, with
    "(with --override)" when there are overrides."""
    named = source
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("", f"cannot read the config file ({exc.strerror})", source) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("", f"not valid YAML{where}", source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", "the top level must be a mapping of sections", source)
    data = _auto_layout(data)  # before overrides, which may set keys of the section
    for assignment in overrides:
        apply_override(data, assignment)
    if named is not None:
        source = named
    elif overrides:
        source = f"{source} (with --override)"
    return config_from_dict(data, source, world_size)


SECTION_ORDER = (
    "general", "parallelism", "model", "tokenizer", "tokens", "optimizer",
    "checkpoints", "data_stages", "logging",
)  # fmt: skip


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the config as YAML (atomically), loadable again by load_config."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    raw = cfg.to_dict()
    ordered = {k: raw.pop(k) for k in SECTION_ORDER if k in raw}
    ordered.update(raw)
    tmp.write_text(yaml.safe_dump(ordered, sort_keys=False))
    tmp.replace(target)
