"""Data parallel: gradient accumulation buffers and one bucketed reduction per optimizer step.

Each parameter gets `param.main_grad`, a view into a flat per-bucket buffer (fp32 when
accumulating in fp32, else the parameter's dtype). A post-accumulate-grad hook adds `param.grad`
into it and frees `param.grad`, so micro-batches accumulate locally and nothing is communicated
until the last micro-batch. `arm()` (the pipeline's `on_last_backward`) makes the hooks count
arrivals: when every gradient of a bucket has arrived in the last backward, that bucket's
asynchronous all-reduce (or reduce-scatter for ZeRO-1 on NCCL) starts while the backward goes
on. `finish()` launches whatever is left, waits, and divides by dp, so the result is the mean
over data-parallel replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function


@dataclass
class Bucket:
    """A contiguous group of parameters whose gradients are reduced by one collective."""

    params: list[nn.Parameter]
    offsets: list[int]  # start of each parameter inside `grad`
    numel: int  # used elements; `grad` may be padded up to a multiple of dp
    grad: torch.Tensor
    handle: dist.Work | None = None
    scatter_out: torch.Tensor | None = None
    launched: bool = False
    seen: set[int] = field(default_factory=set)
    full: bool = False  # always all-reduced (e.g. tied parameters, summed across stages later)

    def chunk_range(self, rank: int, world: int) -> tuple[int, int]:
        """This dp rank's slice of the (padded) flat buffer, used by ZeRO-1."""
        size = self.grad.numel() // world
        return rank * size, (rank + 1) * size


class DataParallelGrads:
    """Gradient buffers for the parameters of one model stage, reduced over `dp_group`.

    `reduce_scatter=True` (ZeRO-1 on NCCL) leaves only this rank's chunk of each bucket
    reduced; otherwise every rank holds the full averaged gradient. Parameters whose id is in
    `full_reduce` get buckets of their own that are always all-reduced.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        dp_size: int,
        dp_rank: int,
        grad_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 25.0,
        pad_to: int = 1,
        reduce_scatter: bool = False,
        full_reduce: set[int] | None = None,
    ) -> None:
        unique: list[nn.Parameter] = []
        seen: set[int] = set()
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.params = unique
        self.dp_group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        self.reduce_scatter = reduce_scatter and dp_size > 1
        self.armed = False
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        # Gradients arrive roughly in reverse order of definition: bucket from the end.
        cap = max(int(bucket_cap_mb * 2**20 / 4), 1)
        full_reduce = full_reduce or set()
        for p in reversed(unique):
            if id(p) in full_reduce:
                self._add_bucket([p], grad_dtype, pad_to, full=True)
        group: list[nn.Parameter] = []
        for p in reversed(unique):
            if id(p) in full_reduce:
                continue
            group.append(p)
            if sum(q.numel() for q in group) >= cap:
                self._add_bucket(group, grad_dtype, pad_to)
                group = []
        if group:
            self._add_bucket(group, grad_dtype, pad_to)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in unique]

    def _add_bucket(
        self,
        group: list[nn.Parameter],
        grad_dtype: torch.dtype | None,
        pad_to: int,
        full: bool = False,
    ) -> None:
        dtypes = {p.dtype for p in group}
        if len(dtypes) != 1:
            raise ValueError(f"a gradient bucket mixes parameter dtypes {dtypes}")
        dtype = grad_dtype or group[0].dtype
        offsets, total = [], 0
        for p in group:
            offsets.append(total)
            total += p.numel()
        padded = -(-total // pad_to) * pad_to
        grad = torch.zeros(padded, dtype=dtype, device=group[0].device)
        bucket = Bucket(params=list(group), offsets=offsets, numel=total, grad=grad, full=full)
        for p, off in zip(group, offsets):
            p.main_grad = grad[off : off + p.numel()].view_as(p)
            self._bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    def _on_grad(self, param: nn.Parameter) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if not self.armed:
            return
        bucket = self._bucket_of[id(param)]
        if id(param) in bucket.seen:
            return
        bucket.seen.add(id(param))
        if len(bucket.seen) == len(bucket.params):
            self._launch(bucket)

    def arm(self) -> None:
        """Called before the step's last backward: buckets reduce as soon as they are complete."""
        self.armed = True

    def _launch(self, bucket: Bucket) -> None:
        if bucket.launched:
            return
        bucket.launched = True
        if self.dp_size == 1:
            return
        with record_function("dp.reduce_launch"):
            self._launch_collective(bucket)

    def _launch_collective(self, bucket: Bucket) -> None:
        if self.reduce_scatter and not bucket.full:
            lo, hi = bucket.chunk_range(self.dp_rank, self.dp_size)
            bucket.scatter_out = torch.empty(
                hi - lo, dtype=bucket.grad.dtype, device=bucket.grad.device
            )
            bucket.handle = dist.reduce_scatter_tensor(
                bucket.scatter_out, bucket.grad, group=self.dp_group, async_op=True
            )
        else:
            bucket.handle = dist.all_reduce(bucket.grad, group=self.dp_group, async_op=True)

    def finish(self) -> None:
        """Reduce every bucket not yet reduced, wait for all, and average over dp."""
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                with record_function("dp.reduce_wait"):
                    bucket.handle.wait()
                bucket.handle = None
            if bucket.scatter_out is not None:
                lo, hi = bucket.chunk_range(self.dp_rank, self.dp_size)
                bucket.grad[lo:hi].copy_(bucket.scatter_out)
                bucket.scatter_out = None
            if self.dp_size > 1:
                bucket.grad.div_(self.dp_size)
        self.armed = False

    def zero_grad(self) -> None:
        """Start a new step: empty buffers, disarmed hooks."""
        for bucket in self.buckets:
            bucket.grad.zero_()
            bucket.seen.clear()
            bucket.launched = False
            bucket.handle = None
        self.armed = False

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
