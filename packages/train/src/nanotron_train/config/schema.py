"""The training config: Nanotron's YAML sections and key names, as dataclasses.

Only the shape and the defaults: load.py reads a file into these classes (loader.py checks
each key's type) and runs the tables of checks.py.

Every field of Nanotron's config dataclasses is here, with Nanotron's default, so that a YAML
Nanotron writes loads as it is; README.md's key table says what each one does here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

from nanotron_models.families import config_classes
from nanotron_train.config.evaluation import EvaluationArgs
from nanotron_train.config.loader import to_dict
from nanotron_train.data.stages import DatasetSpec

LogLevel = Literal["debug", "info", "warning", "error", "critical", "passive"]
# `model.model_config`: the config class of any family (nanotron_models.families' rows).
ModelConfig = Union[config_classes()]  # noqa: UP007 (a union built from the registry)


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
    pp_engine: Literal["afab", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"] = "afab"
    pp_virtual_stages: int = 1  # model chunks per rank (interleaved-1f1b only)
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = "ALL_REDUCE"
    tp_linear_async_communication: bool = False
    recompute_layer: bool = False
    tp_recompute_allgather: bool = True
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    # How attention reaches the other cp ranks' keys and values (config/context_parallel.py):
    # allgather | ring | ulysses; null: allgather (ring for _attn_implementation's
    # llama3_ring_attention)
    cp_attention: Literal["allgather", "ring", "ulysses"] | None = None
    # A collective or p2p waiting longer than this fails every rank with who did not arrive
    # (fault/watchdog.py); the backend's own timeout is set a little above it as a backstop.
    collective_timeout_s: float = 600.0
    # Ours: the planner picks dp, tp, pp, pp_engine, tp_mode, recompute_layer, ep and cp (with
    # the ZeRO stage and micro-batch size) for the world size, keeping the global batch
    # (plan/auto.py).
    # `parallelism: auto` in the YAML, or the --auto flag, sets it.
    auto: bool = False


@dataclass
class InitMethod:
    """Nanotron's RandomInit (std, scaling_method), SpectralMupInit (use_mup),
    ExistingCheckpointInit (path) or its Mamba example's MambaInit, as one section: which keys
    are set says which it is."""

    std: float | None = 0.02
    # How the std of the projections into the residual stream (o_proj, down) is scaled:
    # NUM_LAYERS = std / sqrt(2 * num_hidden_layers), NONE = std.
    scaling_method: Literal["NONE", "NUM_LAYERS", "LAYER_INDEX", "MODEL_SCALE"] = "NUM_LAYERS"
    use_mup: bool | None = None
    path: str | None = None  # start from this checkpoint's weights (ours or Nanotron's), step 0
    # Nanotron's Mamba example's MambaInit (config/nanotron_layouts.py): the embedding's std
    # (in place of std), and out_proj / sqrt(n_residuals_per_layer * layers) when rescaled
    initializer_range: float | None = None
    n_residuals_per_layer: int | None = None
    rescale_prenorm_residual: bool | None = None


@dataclass
class ParametrizationArgs:
    """Ours: how initialisation, learning rates and the forward scale with width and depth
    relative to a base model (nanotron_models/parametrization.py): `sp`, `mup` (µTransfer) or
    `completep` (µP and CompleteP's depth scaling). Null base sizes: this model's own."""

    name: Literal["sp", "mup", "completep"] = "sp"
    base_hidden_size: int | None = None
    base_num_layers: int | None = None
    completep_alpha: float = 1.0  # CompleteP's depth exponent, in [0.5, 1]


@dataclass
class ModelArgs:
    # The family is the class the YAML names (`is_qwen2_config: true`), else Llama.
    model_config: ModelConfig
    init_method: InitMethod = field(default_factory=InitMethod)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    make_vocab_size_divisible_by: int = 1
    ddp_bucket_cap_mb: int = 25
    compile: bool = False  # torch.compile each decoder layer (see parallelize.py)
    # lm_head + cross-entropy chunk by chunk, never the fp32 logits of the whole vocab (ours)
    fused_linear_cross_entropy: bool = True
    parametrization: ParametrizationArgs = field(default_factory=ParametrizationArgs)


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
    """Nanotron's AdamWOptimizerArgs or SGDOptimizerArgs (`name: sgd`, no adam_* keys), or
    `name: muon`: Muon for the hidden 2-D weights (the muon_* keys, torch.optim.Muon's
    defaults), AdamW (the adam_* keys) for embeddings, lm_head, norms and biases."""

    name: Literal["adamW", "sgd", "muon"] = "adamW"
    adam_beta1: float | None = None  # 0.9 for adamW when not given
    adam_beta2: float | None = None  # 0.95
    adam_eps: float | None = None  # 1e-8
    torch_adam_is_fused: bool | None = None  # false
    muon_learning_rate: float | None = None  # peak; follows the schedule. None: learning_rate
    muon_weight_decay: float | None = None  # None: optimizer.weight_decay
    muon_momentum: float | None = None  # 0.95
    muon_nesterov: bool | None = None  # true
    muon_ns_coefficients: list[float] | None = None  # [3.4445, -4.7750, 2.0315]
    muon_ns_steps: int | None = None  # 5
    muon_eps: float | None = None  # 1e-7
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None  # original
    muon_ns_dtype: Literal["bfloat16", "float32"] | None = None  # bfloat16, as torch's


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
    # Telemetry of a parallel run (telemetry/; checked in config/telemetry.py).
    rank_stats_interval: int = 10  # per-rank step-time split and memory; 0 = off
    straggler_margin: float = 0.5  # non-waiting time above the median by this fraction ...
    straggler_intervals: int = 6  # ... over a window of this many intervals, read against the noise
    pipeline_timeline_interval: int = 0  # one step's forward/backward spans; 0 = off
    throughput_drop_fraction: float = 0.5  # tokens/s below this share of its median: event
    sample_prompts: list[str] = field(default_factory=list)  # greedy samples at checkpoints
    sample_max_new_tokens: int = 32


@dataclass
class MetricsLoggingArgs:
    """Nanotron's `metrics_logging`: log_level 1 adds per-layer statistics (weight norm,
    gradient norm, update/weight ratio, activation RMS: reporting/layer_stats.py) to the
    record of every log_detail_interval-th step (such a step is logged); 0 = none."""

    log_level: int = 0
    log_detail_interval: int = 10


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


@dataclass
class FaultToleranceArgs:
    """What happens on a non-finite loss or gradient norm, loss-spike detection, stack dumps.

    nonfinite_policy: `stop` (exit naming the step and the first parameter with a non-finite
    gradient), `skip` (no optimizer step; counted and logged) or `rollback` (reload the last
    checkpoint and skip the data of the steps since). loss_spike_window: past losses the robust
    z-score uses (0 = off); loss_spike_zscore: the threshold; grad_norm_spike_window and
    grad_norm_spike_zscore: the same for the gradient norm. stack_dump_dir: where a hung
    rank writes all its threads' stacks (one file per rank). loss_spike_policy: `warn`, or
    `rollback` (fault/spike_recovery.py): back to the newest checkpoint at least
    spike_rollback_min_steps steps before the spike, the data up to the spike not replayed and
    the next spike_skip_batches batches skipped, at most max_spike_rollbacks times per run.
    """

    nonfinite_policy: Literal["stop", "skip", "rollback"] = "stop"
    loss_spike_window: int = 100
    loss_spike_zscore: float = 6.0
    grad_norm_spike_window: int = 100
    grad_norm_spike_zscore: float = 6.0
    stack_dump_dir: str = "stack_dumps"
    loss_spike_policy: Literal["warn", "rollback"] = "warn"
    spike_rollback_min_steps: int = 1  # N: the checkpoint is at least this many steps back
    spike_skip_batches: int = 0  # M: batches after the spike's own that are skipped
    max_spike_rollbacks: int = 3  # K: a spike after K rollbacks stops the run


@dataclass
class ValidationArgs:
    dataset: DatasetSpec | None = None  # dataset_folder and dataset_weights, as in training
    split: float | None = None  # fraction of each training folder's documents held out


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
    profiler: ProfilerArgs | None = None  # torch.profiler traces (reporting/profiling.py)
    fault_tolerance: FaultToleranceArgs = field(default_factory=FaultToleranceArgs)
    validation: ValidationArgs | None = None  # held-out evaluation (checks: validation.py)
    metrics_logging: MetricsLoggingArgs | None = None  # per-layer statistics
    # downstream evaluation of checkpoints (config/evaluation.py; Nanotron's `lighteval`
    # section is read as one, its keys that do not map warned about)
    evaluation: EvaluationArgs | None = None
    lighteval: dict[str, Any] | None = None
    # Nanotron features this project does not have: null, or refused with one line.
    s3_upload: dict[str, Any] | None = None

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
