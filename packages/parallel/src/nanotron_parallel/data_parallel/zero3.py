"""ZeRO-3: parameters sharded too; each block's full parameters live only while it runs.

Buckets follow the stage's blocks (embedding, each decoder layer, final norm, lm_head): one
bucket per block, padded to dp and cut into dp chunks exactly as for ZeRO-1/2, so the ranges a
rank steps, the optimizer pieces and the checkpoint format are the same. Each bucket keeps:

- `param_shard`: this rank's chunk of the parameter values, always resident (the optimizer
  steps it: fp32 models step it in place, low-precision ones copy their masters into it);
- `param_full`: the padded flat parameters of the block, whose storage is allocated only while
  gathered. The module's parameters are views of it (same shapes, same names), so autograd,
  tensor-parallel layers and checkpoints see ordinary tensors when it is gathered.

Hooks on each block (its *unit*: the buckets its parameters belong to; a tied lm_head at pp = 1
uses the embedding's bucket):

- before its forward: gather (all-gather of the shards), then start the next block's gather
  (prefetch, asynchronous);
- after its forward: release, and register a hook on its output's gradient;
- that gradient hook (the block's backward is next): gather, prefetch the previous block;
- when every parameter of the bucket has received its gradient in this backward: release.
  A callback at the end of each backward releases anything left (a parameter without a
  gradient). Under recompute the forward runs again inside the backward: the bucket is
  already gathered and marked as in backward, so that forward neither releases nor prefetches.

Gradients are then those of ZeRO-2 (accumulated in per-block full buffers over the
micro-batches, reduce-scattered into `shard`, full buffers released). `full_parameters()`
gathers everything for checkpoints and checks and writes any change back to the shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from nanotron_parallel.data_parallel.buckets import Bucket
from nanotron_parallel.data_parallel.zero import ZeroTwoGrads, alloc_storage, free_storage
from nanotron_parallel.phase_timer import comm_span
from nanotron_parallel.tensor_parallel.functional import _all_gather_tensor


@dataclass
class Unit:
    """One block and the buckets its forward and backward need."""

    module: nn.Module
    buckets: list[Bucket] = field(default_factory=list)


class ZeroThreeGrads(ZeroTwoGrads):
    """ZeroTwoGrads whose parameters are sharded over dp and gathered block by block."""

    zero_stage = 3

    def __init__(self, *args, blocks: list[tuple[nn.Module, list[nn.Parameter]]], **kwargs) -> None:
        self._blocks = blocks  # read by bucket_groups during the base constructor
        super().__init__(*args, **kwargs)
        self.gathered_bytes = 0  # parameter bytes gathered now, and the most at once
        self.peak_gathered_bytes = 0
        for bucket in self.buckets:
            self._shard_parameters(bucket)
        self.units = []
        for block, reads in blocks:
            unit = Unit(block)
            for p in reads:
                bucket = self._bucket_of.get(id(p))
                if bucket is not None and all(b is not bucket for b in unit.buckets):
                    unit.buckets.append(bucket)
            if unit.buckets:
                self.units.append(unit)
        self._callback_queued = False
        self._all_full = False  # inside full_parameters(): the block hooks stand aside
        for index, unit in enumerate(self.units):
            self._hooks.append(unit.module.register_forward_pre_hook(self._pre_forward(index)))
            self._hooks.append(unit.module.register_forward_hook(self._post_forward(index)))

    def bucket_groups(self, params, bucket_cap_mb, full_reduce):
        """One bucket per block (a parameter shared by two blocks goes with the first)."""
        wanted = {id(p) for p in params}
        taken: set[int] = set()
        groups = []
        for _, reads in self._blocks:
            group = [p for p in reads if id(p) in wanted and id(p) not in taken]
            taken.update(id(p) for p in group)
            if group:
                groups.append((group, False))
        if len(taken) != len(wanted):
            raise ValueError("ZeRO-3: some trainable parameters belong to none of the blocks")
        return groups[::-1]  # gradients arrive from the last block

    # -- parameter shards ----------------------------------------------------------------

    @torch.no_grad()
    def _shard_parameters(self, bucket: Bucket) -> None:
        first = bucket.params[0]
        full = torch.zeros(bucket.grad.numel(), dtype=first.dtype, device=first.device)
        for p, off in zip(bucket.params, bucket.offsets):
            full[off : off + p.numel()].copy_(p.detach().reshape(-1))
        # Views made while the memory exists (none can be made of a released storage).
        bucket.param_views = self._views(bucket, full)
        for p, view in zip(bucket.params, bucket.param_views):
            p.data = view
        lo, hi = self.owned_span(bucket)
        bucket.param_full = full
        bucket.param_shard = full[lo:hi].clone()
        bucket.gather_handle = None
        bucket.gathered = False
        bucket.in_backward = False
        bucket.arrived = 0
        free_storage(full)

    def _gather(self, bucket: Bucket) -> None:
        """Start the all-gather of `bucket`'s parameters (no-op when gathered or under way)."""
        if bucket.gathered or bucket.gather_handle is not None:
            return
        alloc_storage(bucket.param_full)
        with record_function("zero3.gather_launch"):
            if self.tensor_collectives:
                bucket.gather_handle = _all_gather_tensor(
                    bucket.param_full, bucket.param_shard, group=self.dp_group, async_op=True
                )
            else:
                chunks = list(bucket.param_full.chunk(self.dp_size))
                bucket.gather_handle = dist.all_gather(
                    chunks, bucket.param_shard, group=self.dp_group, async_op=True
                )
        self.gathered_bytes += bucket.param_full.nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _wait(self, bucket: Bucket) -> None:
        self._gather(bucket)
        if bucket.gather_handle is not None:
            with record_function("zero3.gather_wait"), comm_span("dp_gather"):  # telemetry
                bucket.gather_handle.wait()
            bucket.gather_handle = None
        bucket.gathered = True

    def _release(self, bucket: Bucket) -> None:
        if bucket.gather_handle is not None:  # never free memory a collective writes into
            bucket.gather_handle.wait()
            bucket.gather_handle = None
        if bucket.param_full.untyped_storage().nbytes():  # counted in gathered_bytes
            free_storage(bucket.param_full)
            self.gathered_bytes -= bucket.param_full.nbytes
        bucket.gathered = False
        bucket.in_backward = False
        bucket.arrived = 0

    # -- hooks ---------------------------------------------------------------------------

    def _pre_forward(self, index: int):
        def hook(module, args):
            if self._all_full:  # a forward inside full_parameters() (samples' decoding)
                return
            unit = self.units[index]
            for bucket in unit.buckets:
                self._wait(bucket)
            recomputing = any(b.in_backward for b in unit.buckets)
            if not recomputing and index + 1 < len(self.units):
                for bucket in self.units[index + 1].buckets:
                    self._gather(bucket)

        return hook

    def _post_forward(self, index: int):
        def hook(module, args, output):
            if self._all_full:
                return
            unit = self.units[index]
            if any(b.in_backward for b in unit.buckets):  # recompute inside the backward
                return
            if torch.is_grad_enabled() and torch.is_tensor(output) and output.requires_grad:
                output.register_hook(self._pre_backward(index))
            for bucket in unit.buckets:
                self._release(bucket)

        return hook

    def _pre_backward(self, index: int):
        def hook(grad):
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            for bucket in self.units[index].buckets:
                bucket.in_backward = True
                self._wait(bucket)
            if index > 0:
                for bucket in self.units[index - 1].buckets:
                    self._gather(bucket)

        return hook

    def _on_grad(self, param: nn.Parameter, write: Callable | None = None, *operands) -> None:
        super()._on_grad(param, write, *operands)
        bucket = self._bucket_of[id(param)]
        bucket.arrived += 1
        if bucket.arrived == len(bucket.params) and bucket.in_backward:
            self._release(bucket)  # its block's backward is over

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for bucket in self.buckets:
            self._release(bucket)

    # -- what the optimizer, checkpoints and the bench see ---------------------------------

    def value_store(self, bucket: Bucket) -> tuple[torch.Tensor, int]:
        return bucket.param_shard, self.owned_span(bucket)[0]

    def gather_params(self) -> None:
        """Nothing: the stepped shards are gathered block by block by the next forward."""

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Every parameter full, in temporary buffers (a checkpoint's numpy views would pin
        `param_full`'s memory: it could never be released again); on exit the values go back
        to the shards and the parameters to their released views. Forwards run inside it
        gather and release nothing, so one dp rank may run them alone (samples decode so)."""
        temporary = []
        for bucket in self.buckets:
            self._release(bucket)
            full = torch.empty_like(bucket.param_full, memory_format=torch.contiguous_format)
            if self.tensor_collectives:
                _all_gather_tensor(full, bucket.param_shard, group=self.dp_group)
            else:
                dist.all_gather(
                    list(full.chunk(self.dp_size)), bucket.param_shard, group=self.dp_group
                )
            for p, view in zip(bucket.params, self._views(bucket, full)):
                p.data = view
            temporary.append(full)
        self._all_full = True
        try:
            yield
        finally:
            self._all_full = False
            with torch.no_grad():
                for bucket, full in zip(self.buckets, temporary):
                    lo, hi = self.owned_span(bucket)
                    bucket.param_shard.copy_(full[lo:hi])
                    for p, view in zip(bucket.params, bucket.param_views):
                        p.data = view

    @staticmethod
    def _views(bucket: Bucket, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[off : off + p.numel()].view_as(p) for p, off in zip(bucket.params, bucket.offsets)
        ]

    def memory_bytes(self) -> dict[str, int]:
        out = super().memory_bytes()
        out["params"] = sum(
            b.param_full.untyped_storage().nbytes() + b.param_shard.nbytes for b in self.buckets
        )
        return out
