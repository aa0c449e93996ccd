"""ZeRO-1: optimizer state and fp32 masters sharded over the data-parallel ranks.

The flat gradient buffer of every bucket (see data_parallel.py) is padded to a multiple of dp
and cut into dp equal chunks; dp rank r owns chunk r of every bucket. It steps only the
parameter elements in its chunks (`owned_ranges`), then `gather_params` rebuilds every full
parameter from the owners. Elementwise optimizers (Adam) therefore give exactly the results of
zero_stage 0, while each rank keeps ~1/dp of the optimizer state.

With `tensor_collectives` (NCCL's default, forced in tests on gloo) the gradients are
reduce-scattered, so each rank only receives its own chunks, and the parameters are gathered
with one all-gather into the flat buffer; otherwise all-reduce and a list all-gather, which
gloo runs faster. Tied buckets are always all-reduced (they are summed across stages after).

`build_data_parallel(zero_stage, ...)` is the one place a zero stage picks its class; ZeRO-2/3
add theirs there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.data_parallel import Bucket, DataParallelGrads
from nanotron_parallel.tensor_parallel.functional import _all_gather_tensor, _reduce_scatter_tensor


class ZeroOneGrads(DataParallelGrads):
    """DataParallelGrads whose optimizer state is sharded: each dp rank owns one chunk."""

    zero_stage = 1

    def pad_to(self) -> int:
        return self.dp_size

    def owned_span(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.chunk_range(self.dp_rank, self.dp_size)

    def counts_in_norm_over_dp(self) -> bool:
        return True  # each rank its own chunks: every element once

    def _launch_collective(self, bucket: Bucket) -> None:
        if not self.tensor_collectives or bucket.full:
            super()._launch_collective(bucket)
            return
        lo, hi = self.owned_span(bucket)
        bucket.scatter_out = bucket.grad.new_empty(hi - lo)
        bucket.handle = _reduce_scatter_tensor(
            bucket.scatter_out, bucket.grad, group=self.dp_group, async_op=True
        )

    @torch.no_grad()
    def gather_params(self) -> None:
        """After each rank stepped its chunks, give every rank the full updated parameters."""
        if self.dp_size == 1:
            return
        for bucket in self.buckets:
            dtype = bucket.params[0].dtype
            flat = torch.zeros(bucket.grad.numel(), dtype=dtype, device=bucket.grad.device)
            for p, off in zip(bucket.params, bucket.offsets):
                flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
            lo, hi = self.owned_span(bucket)
            mine = flat[lo:hi].clone()
            if self.tensor_collectives:
                _all_gather_tensor(flat, mine, group=self.dp_group)
            else:
                dist.all_gather(list(flat.chunk(self.dp_size)), mine, group=self.dp_group)
            for p, off in zip(bucket.params, bucket.offsets):
                p.detach().copy_(flat[off : off + p.numel()].view_as(p))


_BY_STAGE: dict[int, type[DataParallelGrads]] = {0: DataParallelGrads, 1: ZeroOneGrads}


def build_data_parallel(
    zero_stage: int,
    params: list[nn.Parameter],
    dp_group: dist.ProcessGroup | None,
    dp_size: int,
    dp_rank: int,
    **kwargs,
) -> DataParallelGrads:
    """The data-parallel object of `zero_stage` (with dp = 1 a ZeRO stage changes nothing, so
    zero_stage 0 is used). kwargs: grad_dtype, bucket_cap_mb, full_reduce, tensor_collectives."""
    if zero_stage not in _BY_STAGE:
        raise ValueError(f"optimizer.zero_stage={zero_stage} is not supported: {sorted(_BY_STAGE)}")
    cls = _BY_STAGE[zero_stage if dp_size > 1 else 0]
    return cls(params, dp_group, dp_size, dp_rank, **kwargs)
