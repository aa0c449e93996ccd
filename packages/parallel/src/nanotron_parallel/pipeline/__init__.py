"""Pipeline parallelism: stage placement, p2p transfers, the AFAB / 1F1B schedules and the
forward-only one of evaluation."""

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
    ENGINES,
    PipelineScheduleError,
    PipelineStats,
    PipelineStepResult,
    forward_only,
    loss_on_all_pp_ranks,
    run_forward_only,
    run_pipeline_step,
    train_step_1f1b,
    train_step_afab,
)

__all__ = [
    "ENGINES",
    "NO_RECORDER",
    "P2PError",
    "PipelineConfigError",
    "PipelineScheduleError",
    "PipelineStats",
    "PipelineStepResult",
    "StageComm",
    "TensorMeta",
    "TimelineRecorder",
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
