"""The checks a typed config must pass, as tables of rows (rules.py).

Each row names the key its error is about, a predicate on the config, and the message. `validate`
runs the tables in order: single values (values.py), the rows below in the order of Nanotron's
sections, `STAGE_CHECKS` (data_stages.py) once per data stage (`{i}` in their key is the stage
index), then the tables of context parallel, memory-and-speed, fault tolerance, validation and
telemetry. It stops at the first failure (a ConfigError naming the key and the file). The refusal
rows are for whole Nanotron features this project does not have: their message says which feature.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from nanotron_models.config import ModelConfigError
from nanotron_parallel.pipeline import ENGINES
from nanotron_train.config.context_parallel import CONTEXT_PARALLEL_CHECKS
from nanotron_train.config.data_stages import STAGE_CHECKS
from nanotron_train.config.evaluation import EVALUATION_CHECKS
from nanotron_train.config.fault import FAULT_CHECKS
from nanotron_train.config.moe import MOE_CHECKS
from nanotron_train.config.muon import MUON_CHECKS
from nanotron_train.config.perf import PERF_CHECKS
from nanotron_train.config.rules import Check, at_least, below_one, positive, refused, run_checks
from nanotron_train.config.telemetry import TELEMETRY_CHECKS
from nanotron_train.config.validation import VALIDATION_CHECKS
from nanotron_train.config.values import VALUE_CHECKS

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config


def _model_config_error(cfg: Config) -> str | None:
    try:
        cfg.model.model_config.validate(tp=cfg.parallelism.tp)
    except ModelConfigError as exc:
        return str(exc)
    return None


def _model_key(cfg: Config) -> str:
    """The model package's message starts with the field: name it as the key."""
    field = _model_config_error(cfg).split(" ", 1)[0].rstrip(":")
    return "model." + field if field.startswith("model_config") else "model"


def _regex_error(patterns: list[str] | None) -> str | None:
    for pattern in patterns or []:
        try:
            re.compile(pattern)
        except re.error as exc:
            return f"{pattern!r} is not a regular expression ({exc})"
    return None


def _is_s3(path: str | None) -> bool:
    return bool(path) and str(path).startswith("s3://")


_ADAM_KEYS = ("adam_beta1", "adam_beta2", "adam_eps", "torch_adam_is_fused")
_SECTION_FEATURES = {
    "s3_upload": "uploading checkpoints to S3",
}


def _eod_masks(cfg: Config) -> set[bool]:
    return {s.data.dataset.eod_mask_loss for s in cfg.data_stages if s.data.dataset is not None}


CHECKS: tuple[Check, ...] = (
    # general
    Check(
        "general.step",
        lambda c: c.general.step is None or bool(c.checkpoints.resume_checkpoint_path),
        "is the step of the checkpoint this config was saved with: set "
        "checkpoints.resume_checkpoint_path to resume from it, or set it to null",
    ),
    Check(
        "general.consumed_train_samples",
        lambda c: (
            c.general.consumed_train_samples is None or bool(c.checkpoints.resume_checkpoint_path)
        ),
        "is recorded by a checkpoint: set checkpoints.resume_checkpoint_path, or set it to null",
    ),
    # parallelism
    at_least("parallelism.dp", 1),
    at_least("parallelism.tp", 1),
    at_least("parallelism.pp", 1),
    Check(
        "parallelism.tp_linear_async_communication",
        lambda c: (
            not c.parallelism.tp_linear_async_communication
            or c.parallelism.tp_mode == "REDUCE_SCATTER"
        ),
        "requires parallelism.tp_mode: REDUCE_SCATTER (as in Nanotron)",
    ),
    # model
    Check(_model_key, lambda c: _model_config_error(c) is None, _model_config_error),
    Check(
        "parallelism.pp",
        lambda c: c.parallelism.pp <= c.model.model_config.num_hidden_layers,
        lambda c: (
            f"pp={c.parallelism.pp} is more than model.model_config.num_hidden_layers="
            f"{c.model.model_config.num_hidden_layers}"
        ),
    ),
    at_least("model.make_vocab_size_divisible_by", 1),
    Check(  # nanotron_models/parametrization.py (the state-space families: their builders)
        "model.parametrization.name",
        lambda c: c.model.parametrization.name == "sp" or not c.model.init_method.use_mup,
        "mup and completep: not with model.init_method.use_mup (Nanotron's spectral µP, another "
        "parametrization)",
    ),
    positive("model.parametrization.base_hidden_size", nullable=True),
    positive("model.parametrization.base_num_layers", nullable=True),
    Check(
        "model.parametrization.completep_alpha",
        lambda c: 0.5 <= c.model.parametrization.completep_alpha <= 1.0,
        lambda c: f"must be in [0.5, 1], got {c.model.parametrization.completep_alpha}",
    ),
    Check(
        "model.init_method.std",
        lambda c: (
            bool(c.model.init_method.path)
            or (c.model.init_method.std is not None and c.model.init_method.std > 0)
        ),
        lambda c: f"must be > 0, got {c.model.init_method.std}",
    ),
    Check(
        "model.init_method.scaling_method",
        lambda c: c.model.init_method.scaling_method in ("NONE", "NUM_LAYERS"),
        lambda c: (
            f"{c.model.init_method.scaling_method} is not implemented by Nanotron either "
            "(it raises); use NUM_LAYERS or NONE"
        ),
    ),
    # tokenizer
    Check(
        "tokenizer.tokenizer_max_length",
        lambda c: c.tokenizer.tokenizer_max_length is None,
        "is read nowhere, in Nanotron or here (samples are tokens.sequence_length + 1 "
        "tokens): set it to null",
    ),
    # tokens
    at_least("tokens.sequence_length", 1),
    at_least("tokens.micro_batch_size", 1),
    at_least("tokens.batch_accumulation_per_replica", 1),
    at_least("tokens.train_steps", 1),
    # optimizer
    Check(
        "optimizer.zero_stage",
        lambda c: c.optimizer.zero_stage in (0, 1, 2, 3),
        lambda c: f"must be 0, 1, 2 or 3, got {c.optimizer.zero_stage}",
    ),
    Check(
        "optimizer.zero_stage",
        lambda c: not (c.optimizer.zero_stage == 3 and c.model.compile),
        "3 with model.compile: ZeRO-3 frees and re-gathers each block's parameter memory "
        "around its forward, which compiled graphs do not expect; use zero_stage 2 or compile off",
    ),
    # zero-bubble engines (B and W apart): what they cannot follow yet
    Check(
        "parallelism.pp_engine",
        lambda c: not (_splits(c) and c.optimizer.zero_stage == 3),
        lambda c: (
            f"{c.parallelism.pp_engine} with optimizer.zero_stage 3: ZeRO-3 frees each "
            "block's gathered weights after its backward, before the deferred weight gradients "
            "(W) use them; use zero_stage 1 or 2"
        ),
    ),
    Check(
        "parallelism.pp_engine",
        lambda c: not (_splits(c) and c.model.compile),
        lambda c: (
            f"{c.parallelism.pp_engine} with model.compile: the queue of deferred weight "
            "gradients is Python state a compiled backward cannot reach; set model.compile false"
        ),
    ),
    Check(
        "parallelism.pp_engine",
        lambda c: not (_splits(c) and c.parallelism.context_parallel_size > 1),
        lambda c: (
            f"{c.parallelism.pp_engine} with context_parallel_size > 1: the B/W split "
            "is not verified with context parallelism yet; use 1f1b"
        ),
    ),
    Check(
        "optimizer.zero_stage",
        lambda c: (
            c.optimizer.zero_stage != 3 or ENGINES[c.parallelism.pp_engine].gathers_in_stage_order
        ),
        "3 with pp_engine interleaved-1f1b: ZeRO-3 prefetches blocks in one stage's forward "
        "order, which the interleaved engine does not follow; use afab or 1f1b",
    ),
    at_least("optimizer.weight_decay", 0),
    Check(
        "optimizer.weight_decay_exclude_named_params",
        lambda c: _regex_error(c.optimizer.weight_decay_exclude_named_params) is None,
        lambda c: _regex_error(c.optimizer.weight_decay_exclude_named_params),
    ),
    positive("optimizer.clip_grad", nullable=True),
    positive("optimizer.learning_rate_scheduler.learning_rate"),
    at_least("optimizer.learning_rate_scheduler.lr_warmup_steps", 0),
    at_least("optimizer.learning_rate_scheduler.lr_decay_steps", 1, nullable=True),
    Check(
        "optimizer.optimizer_factory",
        lambda c: (
            c.optimizer.optimizer_factory.name != "sgd"
            or all(getattr(c.optimizer.optimizer_factory, k) is None for k in _ADAM_KEYS)
        ),
        f"name: sgd takes none of {', '.join(_ADAM_KEYS)} (they are AdamW's)",
    ),
    below_one("optimizer.optimizer_factory.adam_beta1"),
    below_one("optimizer.optimizer_factory.adam_beta2"),
    positive("optimizer.optimizer_factory.adam_eps", nullable=True),
    # checkpoints
    at_least("checkpoints.checkpoint_interval", 1),
    refused("checkpoints.checkpoints_path", lambda v: not _is_s3(v), "checkpoints on S3"),
    refused("checkpoints.resume_checkpoint_path", lambda v: not _is_s3(v), "checkpoints on S3"),
    Check(
        "checkpoints.save_initial_state",
        lambda c: not c.checkpoints.save_initial_state or bool(c.checkpoints.checkpoints_path),
        "needs checkpoints.checkpoints_path",
    ),
    at_least("checkpoints.keep_last_n", 1, nullable=True),
    # data stages (each stage: STAGE_CHECKS)
    Check("data_stages", lambda c: len(c.data_stages) >= 1, "needs at least one stage"),
    Check(
        "data_stages.0.start_training_step",
        lambda c: c.data_stages[0].start_training_step == 1,
        lambda c: f"must be 1, got {c.data_stages[0].start_training_step}",
    ),
    Check(
        "data_stages",
        lambda c: (
            [s.start_training_step for s in c.data_stages]
            == sorted({s.start_training_step for s in c.data_stages})
        ),
        lambda c: (
            "start_training_step values must be increasing, got "
            f"{[s.start_training_step for s in c.data_stages]}"
        ),
    ),
    Check(
        "data_stages",
        lambda c: len({s.name for s in c.data_stages}) == len(c.data_stages),
        lambda c: f"stage names must be unique, got {[s.name for s in c.data_stages]}",
    ),
    Check(  # the held-out documents are evaluated one way
        "data_stages",
        lambda c: c.validation is None or c.validation.split is None or len(_eod_masks(c)) < 2,
        "data.dataset.eod_mask_loss differs between stages: with validation.split, set it the "
        "same in every stage (it also decides the validation labels)",
    ),
    # logging
    at_least("logging.iteration_step_info_interval", 1),
    # whole sections of absent features
    *(refused(name, lambda v: v is None, feature) for name, feature in _SECTION_FEATURES.items()),
)


def _world_size_check(world_size: int | None) -> Check:
    """dp*cp*tp*pp must be the number of processes launched (when it is known)."""

    def product(c: Config) -> int:
        par = c.parallelism
        return par.dp * par.context_parallel_size * par.tp * par.pp

    def message(c: Config) -> str:
        par = c.parallelism
        cp = par.context_parallel_size
        names, values = (
            ("dp*cp*tp*pp", f"{par.dp}*{cp}*") if cp != 1 else ("dp*tp*pp", f"{par.dp}*")
        )
        return (
            f"{names} = {values}{par.tp}*{par.pp} = {product(c)} but the world size is {world_size}"
        )

    # parallelism.auto: the layout is chosen for the world size after loading (plan/auto.py)
    return Check(
        "parallelism",
        lambda c: world_size is None or c.parallelism.auto or product(c) == world_size,
        message,
    )


def validate(cfg: Config, source: str, world_size: int | None = None) -> Config:
    """Run every table; the first failure is a ConfigError naming its key and `source`."""
    run_checks((_world_size_check(world_size), *VALUE_CHECKS, *CHECKS), source, cfg)
    for i, stage in enumerate(cfg.data_stages):
        run_checks(STAGE_CHECKS, source, cfg, stage, index=i)
    for table in (
        MUON_CHECKS, MOE_CHECKS, CONTEXT_PARALLEL_CHECKS, PERF_CHECKS, FAULT_CHECKS, VALIDATION_CHECKS,
        TELEMETRY_CHECKS, EVALUATION_CHECKS,
    ):  # fmt: skip
        run_checks(table, source, cfg)
    return cfg


def _splits(c) -> bool:
    """Whether the engine runs weight gradients apart from input gradients (zero-bubble)."""
    return ENGINES[c.parallelism.pp_engine].splits_backward
