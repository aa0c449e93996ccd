"""ZeRO-1 and ZeRO-2: optimizer state (and, at 2, gradients) sharded over the data-parallel ranks.

The flat gradient buffer of every bucket (see buckets.py) is padded to a multiple of dp
and cut into dp equal chunks; dp rank r owns chunk r of every bucket. It steps only the
parameter elements in its chunks (`owned_pieces`), then `gather_params` rebuilds every full
parameter from the owners. Elementwise optimizers (Adam) therefore give exactly the results of
zero_stage 0, while each rank keeps ~1/dp of the optimizer state.

With `tensor_collectives` (NCCL's default, forced in tests on gloo) the gradients are
reduce-scattered, so each rank only receives its own chunks, and the parameters are gathered
with one all-gather into the flat buffer; otherwise all-reduce and a list all-gather, which
gloo runs faster. Tied buckets are always all-reduced (they are summed across stages after).

ZeRO-2 (`ZeroTwoGrads`) keeps only the reduced chunk of the gradients between steps (see its
docstring); ZeRO-3 is zero3.py. `build_data_parallel(zero_stage, ...)` (this package's
`__init__`) is the one place a zero stage picks its class.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from nanotron_parallel.data_parallel.buckets import Bucket, DataParallelGrads
from nanotron_parallel.phase_timer import comm_span
from nanotron_parallel.tensor_parallel.functional import _all_gather_tensor, _reduce_scatter_tensor


class ZeroOneGrads(DataParallelGrads):
    """DataParallelGrads whose optimizer state is sharded: each dp rank owns one chunk."""

    zero_stage = 1

    def pad_to(self) -> int:
        return self.dp_size

    def owned_span(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.chunk_range(self.dp_rank, self.dp_size)

    def norm_span(self, bucket: Bucket) -> tuple[int, int]:
        return self.owned_span(bucket)  # each rank its own chunks: every element once

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
            flat = torch.empty_like(bucket.grad, dtype=bucket.params[0].dtype)
            mine = self._own_values(bucket)
            # telemetry: waiting here for the slowest dp rank is not this rank's optimizer work
            with comm_span("optimizer_comm"):
                if self.tensor_collectives:
                    _all_gather_tensor(flat, mine, group=self.dp_group)
                else:
                    dist.all_gather(list(flat.chunk(self.dp_size)), mine, group=self.dp_group)
            for p, off in zip(bucket.params, bucket.offsets):
                p.detach().copy_(flat[off : off + p.numel()].view_as(p))

    def _own_values(self, bucket: Bucket) -> torch.Tensor:
        """A copy of this rank's chunk of the bucket's parameter values (its padding zero):
        only that chunk is copied out, the all-gather fills the rest."""
        lo, hi = self.owned_span(bucket)
        mine = torch.empty(hi - lo, dtype=bucket.params[0].dtype, device=bucket.grad.device)
        if hi > bucket.numel:
            mine[max(bucket.numel, lo) - lo :].zero_()
        for p, off, a, b in bucket.ranges_in(lo, hi):
            mine[a - lo : b - lo].copy_(p.detach().reshape(-1)[a - off : b - off])
        return mine


def free_storage(t: torch.Tensor) -> None:
    """Release the memory of `t` (a base tensor) but keep the tensor and every view of it:
    shapes stay, and `alloc_storage` brings the memory back under the same views."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class ZeroTwoGrads(ZeroOneGrads):
    """ZeRO-2: gradients sharded too. Micro-batches still accumulate into the full buffers
    (allocated when the step's first gradient of a bucket arrives), but the reduction writes
    only this rank's chunk into `bucket.shard`, after which the full buffer's memory is
    released: between steps a rank holds 1/dp of the gradients. Tied buckets are
    reduce-scattered too; their copies on the first and last stage have the same chunks, so
    the tied sum runs on the shards (`tied_grad`)."""

    zero_stage = 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for bucket in self.buckets:
            lo, hi = self.owned_span(bucket)
            bucket.shard = bucket.grad.new_zeros(hi - lo)
            free_storage(bucket.grad)
            bucket.resident = False

    def _materialise(self, bucket: Bucket) -> None:
        alloc_storage(bucket.grad)
        bucket.grad.zero_()
        bucket.resident = True

    def _on_grad(self, param: nn.Parameter, write: Callable | None = None, *operands) -> None:
        bucket = self._bucket_of[id(param)]
        if not bucket.resident:
            self._materialise(bucket)
        super()._on_grad(param, write, *operands)

    def _launch_collective(self, bucket: Bucket) -> None:
        if not bucket.resident:  # no gradient reached it this step (a stage that saw no data)
            self._materialise(bucket)
        if self.tensor_collectives:
            bucket.handle = _reduce_scatter_tensor(
                bucket.shard, bucket.grad, group=self.dp_group, async_op=True
            )
        else:
            bucket.handle = dist.all_reduce(bucket.grad, group=self.dp_group, async_op=True)

    def finish(self) -> None:
        """Reduce every bucket into this rank's shards, then release the full buffers."""
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                with record_function("dp.reduce_wait"):
                    bucket.handle.wait()
                bucket.handle = None
            if not self.tensor_collectives:  # all-reduced: keep this rank's chunk
                lo, hi = self.owned_span(bucket)
                bucket.shard.copy_(bucket.grad[lo:hi])
            free_storage(bucket.grad)
            bucket.resident = False
        self.armed = False

    def grad_store(self, bucket: Bucket) -> tuple[torch.Tensor, int]:
        return bucket.shard, self.owned_span(bucket)[0]

    def tied_grad(self, param: nn.Parameter) -> torch.Tensor:
        return self._bucket_of[id(param)].shard  # a tied parameter has a bucket of its own

    def local_grads(self, param: nn.Parameter) -> list[torch.Tensor]:
        return [pc.grad for pc in self.owned_pieces() if pc.param is param]
