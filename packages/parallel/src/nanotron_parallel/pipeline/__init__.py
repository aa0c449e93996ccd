"""Pipeline parallelism: stage placement, p2p transfers and the AFAB / 1F1B schedules."""

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
from nanotron_parallel.pipeline.schedules import (
    ENGINES,
    PipelineScheduleError,
    PipelineStats,
    PipelineStepResult,
    loss_on_all_pp_ranks,
    run_pipeline_step,
    train_step_1f1b,
    train_step_afab,
)

__all__ = [
    "ENGINES",
    "P2PError",
    "PipelineConfigError",
    "PipelineScheduleError",
    "PipelineStats",
    "PipelineStepResult",
    "StageComm",
    "TensorMeta",
    "exchange",
    "loss_on_all_pp_ranks",
    "partition_blocks",
    "pinned_ends",
    "recv_tensor",
    "run_pipeline_step",
    "send_tensor",
    "stage_block_names",
    "train_step_1f1b",
    "train_step_afab",
]
