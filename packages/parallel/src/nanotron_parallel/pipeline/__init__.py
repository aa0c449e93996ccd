"""Pipeline parallelism: stage placement, p2p transfers, and the engines (AFAB, 1F1B,
interleaved 1F1B; each a training step and a forward-only step) found by name in engines.py."""

from nanotron_parallel.pipeline.engines import (
    ENGINES,
    PipelineEngine,
    engine,
    run_forward_only,
    run_pipeline_step,
)
from nanotron_parallel.pipeline.p2p import (
    P2PError,
    StageComm,
    TensorMeta,
    exchange,
    recv_tensor,
    send_tensor,
)
from nanotron_parallel.pipeline.partition import (
    PipelineConfigError,
    partition_blocks,
    pinned_ends,
    stage_block_names,
)
from nanotron_parallel.pipeline.recorder import NO_RECORDER, TimelineRecorder
from nanotron_parallel.pipeline.schedules import (
    PipelineScheduleError,
    PipelineStats,
    PipelineStepResult,
    forward_only,
    loss_on_all_pp_ranks,
    train_step_1f1b,
    train_step_afab,
)

__all__ = [
    "ENGINES",
    "NO_RECORDER",
    "P2PError",
    "PipelineConfigError",
    "PipelineEngine",
    "PipelineScheduleError",
    "PipelineStats",
    "PipelineStepResult",
    "StageComm",
    "TensorMeta",
    "TimelineRecorder",
    "engine",
    "exchange",
    "forward_only",
    "loss_on_all_pp_ranks",
    "partition_blocks",
    "pinned_ends",
    "recv_tensor",
    "run_forward_only",
    "run_pipeline_step",
    "send_tensor",
    "stage_block_names",
    "train_step_1f1b",
    "train_step_afab",
]
