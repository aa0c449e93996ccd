"""The training config: Nanotron's YAML sections and key names, as dataclasses.

`load_config(path, overrides, world_size)` reads, applies `--override section.key=value`,
type-checks every key (unknown key, wrong type, missing value = ConfigError naming the key and
the file) and runs the checks of config_checks.py (combinations, refused Nanotron features).
It needs no process group, so every rank runs it before anything distributed starts.

Every field of Nanotron's config dataclasses is here, with Nanotron's default, so that a YAML
Nanotron writes loads as it is; README.md's key table says what each one does here.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from nanotron_models.config import LlamaConfig
from nanotron_train.config.checks import validate
from nanotron_train.config.fault import FaultToleranceArgs
from nanotron_train.config.loader import ConfigError, apply_override, from_dict, to_dict
from nanotron_train.config.perf import ProfilerArgs
from nanotron_train.config.validation import ValidationArgs
from nanotron_train.data.stages import DatasetSpec

__all__ = ["Config", "ConfigError", "load_config", "config_from_dict", "save_config"]

LogLevel = Literal["debug", "info", "warning", "error", "critical", "passive"]


@dataclass
class GeneralArgs:
    project: str = "nanotron"
    run: str | None = None  # %date and %jobid (SLURM_JOB_ID or "local") are expanded at load
    seed: int = 42
    entity: str | None = None  # ours: the wandb entity (team) of logging.wandb_project
    step: int | None = None  # written into a checkpoint's config; checked on resume
    consumed_train_samples: int | None = None  # likewise
    benchmark_csv_path: str | None = None  # one throughput row appended at the end of training
    ignore_sanity_checks: bool = True  # false: check every step that dp replicas agree
    ignore_memory_check: bool = False  # true: start even when memory_estimate.py says no fit


@dataclass
class ParallelismArgs:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    pp_engine: Literal["afab", "1f1b", "interleaved-1f1b"] = "afab"
    pp_virtual_stages: int = 1  # model chunks per rank (interleaved-1f1b only)
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = "ALL_REDUCE"
    tp_linear_async_communication: bool = False
    recompute_layer: bool = False
    tp_recompute_allgather: bool = True
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    # A collective or p2p waiting longer than this fails every rank with who did not arrive
    # (fault/watchdog.py); the backend's own timeout is set a little above it as a backstop.
    collective_timeout_s: float = 600.0


@dataclass
class InitMethod:
    """Nanotron's RandomInit (std, scaling_method), SpectralMupInit (use_mup) or
    ExistingCheckpointInit (path), as one section: which keys are set says which it is."""

    std: float | None = 0.02
    # How the std of the projections into the residual stream (o_proj, down) is scaled:
    # NUM_LAYERS = std / sqrt(2 * num_hidden_layers), NONE = std.
    scaling_method: Literal["NONE", "NUM_LAYERS", "LAYER_INDEX", "MODEL_SCALE"] = "NUM_LAYERS"
    use_mup: bool | None = None
    path: str | None = None  # start from this checkpoint's weights (ours or Nanotron's), step 0


@dataclass
class ModelArgs:
    model_config: LlamaConfig
    init_method: InitMethod = field(default_factory=InitMethod)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    make_vocab_size_divisible_by: int = 1
    ddp_bucket_cap_mb: int = 25
    compile: bool = False  # torch.compile each decoder layer (see parallelize.py)
    # lm_head + cross-entropy chunk by chunk, never the fp32 logits of the whole vocab (ours)
    fused_linear_cross_entropy: bool = True


@dataclass
class TokenizerArgs:
    tokenizer_name_or_path: str | None = None
    tokenizer_revision: str | None = None  # of a hub name, looked up in the local HF cache
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
    lr_decay_style: Literal["linear", "cosine", "1-sqrt"] = "linear"
    lr_decay_steps: int | None = None
    lr_decay_starting_step: int | None = None
    min_decay_lr: float | None = None


@dataclass
class OptimizerFactoryArgs:
    """Nanotron's AdamWOptimizerArgs or SGDOptimizerArgs (`name: sgd`, no adam_* keys)."""

    name: Literal["adamW", "sgd"] = "adamW"
    adam_beta1: float | None = None  # 0.9 for adamW when not given
    adam_beta2: float | None = None  # 0.95
    adam_eps: float | None = None  # 1e-8
    torch_adam_is_fused: bool | None = None  # false


@dataclass
class OptimizerArgs:
    learning_rate_scheduler: LRSchedulerArgs
    optimizer_factory: OptimizerFactoryArgs = field(default_factory=OptimizerFactoryArgs)
    zero_stage: int = 0
    weight_decay: float = 0.0
    # Regexes (re.match) on parameter names, ours or Nanotron's: those matched get no weight
    # decay. Nanotron's default: every parameter is decayed.
    weight_decay_exclude_named_params: list[str] | None = None
    clip_grad: float | None = None
    accumulate_grad_in_fp32: bool = True


@dataclass
class CheckpointsArgs:
    checkpoints_path: str | None = None  # None: no checkpoints are written
    checkpoint_interval: int = 1000
    resume_checkpoint_path: str | None = None
    save_final_state: bool = True
    save_initial_state: bool = False  # a checkpoint of step 0 before the first step
    keep_last_n: int | None = None
    # Nanotron: which rank creates the folder. Here rank 0 always does, then a barrier, which
    # is right for both; false refuses a path that is not visible to every rank's node.
    checkpoints_path_is_shared_file_system: bool = False
    load_lr_scheduler: bool = True
    load_optimizer: bool = True
    async_save: bool = False  # the step waits only for a host copy (checkpoints/async_save.py)
    on_save_error: Literal["stop", "continue"] = "stop"  # e.g. disk full: stop or train on


@dataclass
class DataArgs:
    dataset: DatasetSpec | None = None  # None = synthetic tokens (Nanotron's dummy data)
    seed: int = 42
    num_loading_workers: int = 1  # steps prepared ahead by a background thread (0: none)


@dataclass
class DatasetStageArgs:
    name: str
    start_training_step: int
    data: DataArgs = field(default_factory=DataArgs)
    sequence_length: int | None = None  # None: tokens.sequence_length


@dataclass
class LoggingArgs:
    iteration_step_info_interval: int = 1
    log_level: LogLevel = "info"  # rank 0 (its step lines are info)
    log_level_replica: LogLevel = "info"  # every other rank
    metrics_file: str | None = None
    dashboard_url: str | None = None
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    # Telemetry of a parallel run (telemetry/, issue 19; checked in telemetry_config.py).
    rank_stats_interval: int = 10  # per-rank step-time split and memory; 0 = off
    straggler_margin: float = 0.2  # non-waiting time above the median by this fraction ...
    straggler_intervals: int = 3  # ... for this many consecutive intervals: a straggler
    pipeline_timeline_interval: int = 0  # one step's forward/backward spans; 0 = off
    throughput_drop_fraction: float = 0.5  # tokens/s below this share of its median: event
    sample_prompts: list[str] = field(default_factory=list)  # greedy samples at checkpoints
    sample_max_new_tokens: int = 32


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
    fault_tolerance: FaultToleranceArgs = field(default_factory=FaultToleranceArgs)
    validation: ValidationArgs | None = None  # held-out evaluation (validation_config.py)
    # Nanotron features this project does not have: null, or refused with one line.
    lighteval: dict[str, Any] | None = None
    s3_upload: dict[str, Any] | None = None
    metrics_logging: dict[str, Any] | None = None

    @property
    def global_batch_size(self) -> int:
        t = self.tokens
        return t.micro_batch_size * t.batch_accumulation_per_replica * self.parallelism.dp

    def sequence_length_at(self, step: int) -> int:
        """The sample length at optimizer step `step` (its data stage's, else tokens')."""
        stage = max(
            (s for s in self.data_stages if s.start_training_step <= step),
            key=lambda s: s.start_training_step,
            default=None,
        )
        return (stage and stage.sequence_length) or self.tokens.sequence_length

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


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
    cfg = from_dict(Config, data, "", source)
    cfg.general.run = expand_run_name(cfg.general.run)
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
