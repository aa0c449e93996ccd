"""Data parallel: gradient buckets reduced once per step, and ZeRO stages 1, 2 and 3.

- buckets.py: `DataParallelGrads` (zero_stage 0), the buckets and the ownership interface the
  optimizer, clipping and checkpoints read (`owned_pieces`, `grad_norm_views`, ...);
- zero.py: ZeRO-1 (optimizer state sharded) and ZeRO-2 (gradients too);
- zero3.py: ZeRO-3 (parameters too, gathered block by block);
- split.py: `SplitGrads`, dense and expert parameters each over their own group, as one.

Each module imports only the ones above it in this list. `build_data_parallel` is the entry:
it picks the class of a zero stage. The reduction group is an argument, never read from a
ParallelContext here: the trainer passes dp x cp, and parameters that another group holds
(experts, say) get their own object over their own group.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from nanotron_parallel.data_parallel.buckets import Bucket, DataParallelGrads, OwnedPiece
from nanotron_parallel.data_parallel.split import SplitGrads
from nanotron_parallel.data_parallel.zero import ZeroOneGrads, ZeroTwoGrads
from nanotron_parallel.data_parallel.zero3 import ZeroThreeGrads

__all__ = [
    "Bucket",
    "DataParallelGrads",
    "OwnedPiece",
    "SplitGrads",
    "ZeroOneGrads",
    "ZeroThreeGrads",
    "ZeroTwoGrads",
    "build_data_parallel",
]

ZERO_STAGES: dict[int, type[DataParallelGrads]] = {
    0: DataParallelGrads,
    1: ZeroOneGrads,
    2: ZeroTwoGrads,
    3: ZeroThreeGrads,
}


def build_data_parallel(
    zero_stage: int,
    params: list[nn.Parameter],
    dp_group: dist.ProcessGroup | None,
    dp_size: int,
    dp_rank: int,
    blocks: list[tuple[nn.Module, list[nn.Parameter]]] | None = None,
    **kwargs,
) -> DataParallelGrads:
    """The data-parallel object of `zero_stage` for `params`, reduced and sharded over
    `dp_group` (of `dp_size` ranks, this one being `dp_rank`): whatever group that is, the
    data-parallel one or data x context parallel. With dp = 1 a ZeRO stage changes nothing,
    so zero_stage 0 is used. `blocks`: the modules the stage calls, in forward order, each
    with the parameters it reads (ZeRO-3 gathers those around its forward and backward).
    kwargs: grad_dtype, bucket_cap_mb, full_reduce, tensor_collectives, grad_scale."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(
            f"optimizer.zero_stage={zero_stage} is not supported: {sorted(ZERO_STAGES)}"
        )
    if dp_size == 1:
        zero_stage = 0
    if zero_stage == 3:
        if blocks is None:
            raise ValueError("ZeRO-3 needs the stage's blocks (build_data_parallel(blocks=...))")
        return ZeroThreeGrads(params, dp_group, dp_size, dp_rank, blocks=blocks, **kwargs)
    return ZERO_STAGES[zero_stage](params, dp_group, dp_size, dp_rank, **kwargs)
