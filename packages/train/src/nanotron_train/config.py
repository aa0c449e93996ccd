"""The training config: Nanotron's YAML sections and key names, as dataclasses, validated.

`load_config(path, overrides, world_size)` reads, applies `--override section.key=value`,
type-checks every key (unknown key, wrong type, missing value = ConfigError naming the key and
the file) and checks the combinations (dp*tp*pp vs world size, heads vs tp, ...). It needs no
process group, so every rank runs it before anything distributed starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from nanotron_models.config import LlamaConfig, ModelConfigError
from nanotron_train.config_loader import ConfigError, apply_override, from_dict, to_dict
from nanotron_train.perf_config import ProfilerArgs, validate_perf

__all__ = ["Config", "ConfigError", "load_config", "config_from_dict", "save_config"]


@dataclass
class GeneralArgs:
    project: str = "nanotron"
    run: str | None = None
    seed: int = 42
    entity: str | None = None
    step: int | None = None
    consumed_train_samples: int | None = None
    benchmark_csv_path: str | None = None
    ignore_sanity_checks: bool = True


@dataclass
class ParallelismArgs:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    pp_engine: Literal["afab", "1f1b", "interleaved-1f1b"] = "1f1b"
    pp_virtual_stages: int = 1  # model chunks per rank (interleaved-1f1b only)
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = "ALL_REDUCE"
    tp_linear_async_communication: bool = False
    recompute_layer: bool = False
    tp_recompute_allgather: bool = False
    expert_parallel_size: int = 1
    context_parallel_size: int = 1


@dataclass
class InitMethod:
    std: float = 0.02


@dataclass
class ModelArgs:
    model_config: LlamaConfig
    init_method: InitMethod = field(default_factory=InitMethod)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    make_vocab_size_divisible_by: int = 1
    ddp_bucket_cap_mb: int = 25
    compile: bool = False  # torch.compile each decoder layer (see perf.py)


@dataclass
class TokenizerArgs:
    tokenizer_name_or_path: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_max_length: int | None = None


@dataclass
class TokensArgs:
    sequence_length: int
    micro_batch_size: int
    batch_accumulation_per_replica: int
    train_steps: int
    val_check_interval: int = -1
    limit_val_batches: int = 0
    limit_test_batches: int = 0


@dataclass
class LRSchedulerArgs:
    learning_rate: float
    lr_warmup_steps: int = 0
    lr_warmup_style: Literal["linear", "constant"] = "linear"
    lr_decay_style: Literal["linear", "cosine", "1-sqrt"] = "cosine"
    lr_decay_steps: int | None = None
    lr_decay_starting_step: int | None = None
    min_decay_lr: float | None = None


@dataclass
class OptimizerFactoryArgs:
    name: Literal["adamW", "adamw", "AdamW"] = "adamW"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    torch_adam_is_fused: bool = False


@dataclass
class OptimizerArgs:
    learning_rate_scheduler: LRSchedulerArgs
    optimizer_factory: OptimizerFactoryArgs = field(default_factory=OptimizerFactoryArgs)
    zero_stage: int = 0
    weight_decay: float = 0.0
    clip_grad: float | None = None
    accumulate_grad_in_fp32: bool = True


@dataclass
class CheckpointsArgs:
    checkpoints_path: str | None = None  # None: no checkpoints are written
    checkpoint_interval: int = 1000
    resume_checkpoint_path: str | None = None
    save_final_state: bool = True
    save_initial_state: bool = False
    keep_last_n: int | None = None
    checkpoints_path_is_shared_file_system: bool = False
    load_lr_scheduler: bool = True
    load_optimizer: bool = True


@dataclass
class DataArgs:
    # None = synthetic tokens (Nanotron's dummy data); otherwise handed to the data package.
    dataset: dict[str, Any] | None = None
    seed: int = 42
    num_loading_workers: int = 0


@dataclass
class DatasetStageArgs:
    name: str
    start_training_step: int
    data: DataArgs = field(default_factory=DataArgs)


@dataclass
class LoggingArgs:
    iteration_step_info_interval: int = 1
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_level_replica: Literal["debug", "info", "warning", "error"] = "info"
    metrics_file: str | None = None
    dashboard_url: str | None = None
    tensorboard_dir: str | None = None
    wandb_project: str | None = None


@dataclass
class Config:
    model: ModelArgs
    tokens: TokensArgs
    optimizer: OptimizerArgs
    general: GeneralArgs = field(default_factory=GeneralArgs)
    parallelism: ParallelismArgs = field(default_factory=ParallelismArgs)
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    checkpoints: CheckpointsArgs = field(default_factory=CheckpointsArgs)
    data_stages: list[DatasetStageArgs] = field(
        default_factory=lambda: [DatasetStageArgs(name="synthetic", start_training_step=1)]
    )
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    profiler: ProfilerArgs | None = None  # torch.profiler traces (profiling.py)
    # Nanotron sections we accept for compatibility; only null is supported.
    lighteval: dict[str, Any] | None = None
    s3_upload: dict[str, Any] | None = None
    metrics_logging: dict[str, Any] | None = None

    @property
    def global_batch_size(self) -> int:
        t = self.tokens
        return t.micro_batch_size * t.batch_accumulation_per_replica * self.parallelism.dp

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def _check(cond: bool, key: str, message: str, source: str) -> None:
    if not cond:
        raise ConfigError(key, message, source)


def validate(cfg: Config, source: str, world_size: int | None = None) -> Config:
    """Cross-field checks; each failure names the key(s) involved."""
    par, tok, opt = cfg.parallelism, cfg.tokens, cfg.optimizer
    for name in ("dp", "tp", "pp"):
        value = getattr(par, name)
        _check(value >= 1, f"parallelism.{name}", f"must be >= 1, got {value}", source)
    if world_size is not None:
        product = par.dp * par.tp * par.pp
        _check(
            product == world_size,
            "parallelism",
            f"dp*tp*pp = {par.dp}*{par.tp}*{par.pp} = {product} but the world size is {world_size}",
            source,
        )
    for name in ("expert_parallel_size", "context_parallel_size"):
        _check(getattr(par, name) == 1, f"parallelism.{name}", "only 1 is supported", source)
    _check(
        not par.tp_linear_async_communication or par.tp_mode == "REDUCE_SCATTER",
        "parallelism.tp_linear_async_communication",
        "requires parallelism.tp_mode: REDUCE_SCATTER (as in Nanotron)",
        source,
    )
    try:
        cfg.model.model_config.validate(tp=par.tp)
    except ModelConfigError as exc:
        text = str(exc)
        key = "model." + text.split(" ", 1)[0].rstrip(":")
        raise ConfigError(
            key if key.startswith("model.model_config") else "model", text, source
        ) from None
    layers = cfg.model.model_config.num_hidden_layers
    _check(
        par.pp <= layers,
        "parallelism.pp",
        f"pp={par.pp} is more than model.model_config.num_hidden_layers={layers}",
        source,
    )
    _check(
        cfg.model.make_vocab_size_divisible_by >= 1,
        "model.make_vocab_size_divisible_by",
        "must be >= 1",
        source,
    )
    _check(cfg.model.init_method.std > 0, "model.init_method.std", "must be > 0", source)
    for name in (
        "sequence_length",
        "micro_batch_size",
        "batch_accumulation_per_replica",
        "train_steps",
    ):
        value = getattr(tok, name)
        _check(value >= 1, f"tokens.{name}", f"must be >= 1, got {value}", source)
    max_pos = cfg.model.model_config.max_position_embeddings
    _check(
        tok.sequence_length <= max_pos,
        "tokens.sequence_length",
        f"{tok.sequence_length} exceeds model.model_config.max_position_embeddings={max_pos}",
        source,
    )
    if par.tp_mode == "REDUCE_SCATTER":
        _check(
            tok.sequence_length * tok.micro_batch_size % par.tp == 0
            and tok.sequence_length % par.tp == 0,
            "tokens.sequence_length",
            f"must be divisible by tp={par.tp} in REDUCE_SCATTER mode, got {tok.sequence_length}",
            source,
        )
    _check(
        opt.zero_stage in (0, 1),
        "optimizer.zero_stage",
        f"must be 0 or 1, got {opt.zero_stage}",
        source,
    )
    _check(opt.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", source)
    _check(
        opt.clip_grad is None or opt.clip_grad > 0,
        "optimizer.clip_grad",
        "must be > 0 or null",
        source,
    )
    lrs = opt.learning_rate_scheduler
    _check(
        lrs.learning_rate > 0,
        "optimizer.learning_rate_scheduler.learning_rate",
        "must be > 0",
        source,
    )
    _check(
        lrs.lr_warmup_steps >= 0,
        "optimizer.learning_rate_scheduler.lr_warmup_steps",
        "must be >= 0",
        source,
    )
    _check(
        lrs.lr_decay_steps is None or lrs.lr_decay_steps >= 1,
        "optimizer.learning_rate_scheduler.lr_decay_steps",
        "must be >= 1 or null",
        source,
    )
    f = opt.optimizer_factory
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(f, name)
        _check(
            0 <= value < 1,
            f"optimizer.optimizer_factory.{name}",
            f"must be in [0, 1), got {value}",
            source,
        )
    _check(f.adam_eps > 0, "optimizer.optimizer_factory.adam_eps", "must be > 0", source)
    _check(len(cfg.data_stages) >= 1, "data_stages", "needs at least one stage", source)
    _check_datasets(cfg, source)
    starts = [s.start_training_step for s in cfg.data_stages]
    _check(
        starts[0] == 1, "data_stages.0.start_training_step", f"must be 1, got {starts[0]}", source
    )
    _check(
        starts == sorted(set(starts)),
        "data_stages",
        f"start_training_step values must be increasing, got {starts}",
        source,
    )
    _check(
        cfg.logging.iteration_step_info_interval >= 1,
        "logging.iteration_step_info_interval",
        "must be >= 1",
        source,
    )
    _check(
        cfg.checkpoints.checkpoint_interval >= 1,
        "checkpoints.checkpoint_interval",
        "must be >= 1",
        source,
    )
    validate_perf(cfg, source)
    for name in ("lighteval", "s3_upload", "metrics_logging"):
        _check(getattr(cfg, name) is None, name, "is not supported; set it to null", source)
    return cfg


def _check_datasets(cfg: Config, source: str) -> None:
    """Type-check each real dataset section now, so its errors name the key and the file."""
    from nanotron_train.data.stages import DatasetSpec
    from nanotron_train.data_source import dataset_spec_dict

    kinds = {s.data.dataset is None for s in cfg.data_stages}
    _check(
        len(kinds) == 1,
        "data_stages",
        "mixing synthetic (dataset: null) and real datasets is not supported",
        source,
    )
    for i, stage in enumerate(cfg.data_stages):
        if stage.data.dataset is not None:
            from_dict(
                DatasetSpec,
                dataset_spec_dict(stage.data.dataset),
                f"data_stages.{i}.data.dataset",
                source,
            )


def config_from_dict(
    data: dict[str, Any], source: str = "<config>", world_size: int | None = None
) -> Config:
    """Typed config from a raw mapping, validated (world size checked when given)."""
    cfg = from_dict(Config, data, "", source)
    return validate(cfg, source, world_size)


def load_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), world_size: int | None = None
) -> Config:
    """Read a YAML config file, apply `section.key=value` overrides, type-check and validate."""
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
    for assignment in overrides:
        apply_override(data, assignment)
    if overrides:
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


def replace(cfg: Config, **sections: Any) -> Config:
    """A copy of `cfg` with whole sections swapped (handy in tests)."""
    return dataclasses.replace(cfg, **sections)
