"""Data parallel: gradient accumulation buffers and one bucketed reduction per optimizer step.

Each parameter gets `param.main_grad`, a view into a flat per-bucket buffer (fp32 when
accumulating in fp32, else the parameter's dtype). A post-accumulate-grad hook adds `param.grad`
into it, already divided by dp, and frees `param.grad`, so micro-batches accumulate locally and
nothing is communicated until the last micro-batch. The step's first gradient of a parameter is
written rather than added, so the buffers need no clearing pass between steps. A layer whose
weight gradient is a matmul can skip autograd's gradient tensor altogether:
`param.accumulate_grad_product(a, b)` runs `a @ b` straight into the buffer (gradient-
accumulation fusion, accumulate.py); an embedding's `param.accumulate_grad_rows(ids, rows)`
adds its rows there, and the fused lm_head-and-loss's `param.accumulate_grad_scaled(grad,
factor)` its ready gradient times the backward's factor. Each counts as the parameter's
arrival. `arm()` (the pipeline's `on_last_backward`) makes the hooks count arrivals: when every
gradient of a bucket has arrived in the last backward, that bucket's asynchronous all-reduce
(or, for ZeRO, reduce-scatter: see zero.py) starts while the backward goes on. `finish()`
launches whatever is left and waits; the sum of the pre-divided gradients is the mean over
data-parallel replicas, with no pass over the buffers to divide (dividing by a power of two is
exact, so the result is the same bitwise).

This object owns the whole data-parallel policy: buckets, padding, which collective reduces,
which ranges this rank steps (`owned_pieces`) and counts in the gradient norm
(`grad_norm_views`), and the parameter all-gather after the step (`gather_params`, ZeRO-1/2).
It reduces over the group it is given, whatever that group is; `build_data_parallel`
(this package's entry) picks the class for a zero stage.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from nanotron_parallel.data_parallel.accumulate import (
    accumulate,
    accumulate_product,
    accumulate_rows,
    accumulate_scaled,
)

_NORM_PIECE = 1 << 14  # elements per norm row on the CPU (see grad_norm_views)

# What a fusing layer's backward calls on a parameter instead of returning its gradient, and
# how each adds its operands into the buffer: `write(main_grad, *operands, scale, first)`.
FUSED_ACCUMULATIONS = {
    "accumulate_grad_product": accumulate_product,  # a linear: the matmul's two factors
    "accumulate_grad_rows": accumulate_rows,  # an embedding: ids and their gradient rows
    "accumulate_grad_scaled": accumulate_scaled,  # a ready gradient and the backward's factor
}


def _norm_rows(view: torch.Tensor) -> list[torch.Tensor]:
    """A flat view as [k, _NORM_PIECE] rows, and its shorter tail as a 1-D view."""
    k = view.numel() // _NORM_PIECE
    rows = [view[: k * _NORM_PIECE].view(k, _NORM_PIECE)] if k else []
    return rows + ([view[k * _NORM_PIECE :]] if view.numel() > k * _NORM_PIECE else [])


@dataclass
class OwnedPiece:
    """Elements [start, end) of `param` (flat) that this rank steps: `value` is where they live
    (a view of the parameter, or of its ZeRO-3 shard) and `grad` their reduced gradient."""

    param: nn.Parameter
    start: int
    end: int
    value: torch.Tensor
    grad: torch.Tensor


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
    shard: torch.Tensor | None = None  # ZeRO-2/3: the reduced gradient of this rank's chunk
    resident: bool = True  # whether `grad`'s storage is allocated (ZeRO-2/3 free it)

    def ranges_in(self, lo: int, hi: int) -> Iterator[tuple[nn.Parameter, int, int, int]]:
        """(parameter, its offset, start, end) for each parameter meeting the flat range
        [lo, hi), its [start, end) clipped to that range."""
        for p, off in zip(self.params, self.offsets):
            start, end = max(off, lo), min(off + p.numel(), hi)
            if start < end:
                yield p, off, start, end

    def chunk_range(self, rank: int, world: int) -> tuple[int, int]:
        """This dp rank's slice of the (padded) flat buffer, used by ZeRO-1."""
        size = self.grad.numel() // world
        return rank * size, (rank + 1) * size


class DataParallelGrads:
    """Gradient buffers for the parameters of one model stage, reduced over `dp_group`; every
    rank holds the full averaged gradient and steps every parameter (zero_stage 0).

    Parameters whose id is in `full_reduce` get buckets of their own that are always
    all-reduced. Subclasses (zero.py, zero3.py) change the padding, the collective and the
    ownership.
    """

    zero_stage = 0

    def __init__(
        self,
        params: list[nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        dp_size: int,
        dp_rank: int,
        grad_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 25.0,
        full_reduce: set[int] | None = None,
        tensor_collectives: bool | None = None,
        grad_scale: float | None = None,
    ) -> None:
        """`grad_scale`: the factor each gradient is added with (default 1 / dp_size: the
        reduction sums means). Expert parameters reduce over a smaller group but are scaled
        like dense ones, by the full dp x cp count."""
        unique: list[nn.Parameter] = []
        seen: set[int] = set()
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.params = unique
        self.dp_group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        # NCCL's reduce-scatter / all-gather into one tensor; on gloo all-reduce + slice and a
        # list all-gather are faster, but tests force these paths there too.
        if tensor_collectives is None:
            tensor_collectives = dp_group is not None and dist.get_backend(dp_group) == "nccl"
        self.tensor_collectives = tensor_collectives
        # pre-divided in the hook: the reduction sums means
        self._grad_scale = 1.0 / dp_size if grad_scale is None else grad_scale
        self._norm_views: list[torch.Tensor] | None = None
        self._written: set[int] = set()  # parameters whose buffer holds this step's gradient
        self.armed = False
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        for group, full in self.bucket_groups(unique, bucket_cap_mb, full_reduce or set()):
            self._add_bucket(group, grad_dtype, self.pad_to(), full)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_autograd) for p in unique]
        for p in unique:
            for name, write in FUSED_ACCUMULATIONS.items():
                setattr(p, name, functools.partial(self._on_grad, p, write))

    def bucket_groups(
        self, params: list[nn.Parameter], bucket_cap_mb: float, full_reduce: set[int]
    ) -> list[tuple[list[nn.Parameter], bool]]:
        """The parameters of each bucket, and whether it is always all-reduced: the
        `full_reduce` ones alone, the rest by size. Gradients arrive roughly in reverse order of
        definition: bucket from the end."""
        cap = max(int(bucket_cap_mb * 2**20 / 4), 1)
        out = [([p], True) for p in reversed(params) if id(p) in full_reduce]
        group: list[nn.Parameter] = []
        rest = [p for p in params if id(p) not in full_reduce]
        for p in reversed(rest):
            if p is rest[0] and group and 4 * p.numel() >= cap:
                # The last gradient to arrive (the embedding's, say) is large: alone, so the
                # parameters before it start their reduction without waiting for it.
                out.append((group, False))
                group = []
            group.append(p)
            if sum(q.numel() for q in group) >= cap:
                out.append((group, False))
                group = []
        if group:
            out.append((group, False))
        return out

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

    def pad_to(self) -> int:
        """Each bucket's buffer is padded to a multiple of this (ZeRO: dp equal chunks)."""
        return 1

    def _on_autograd(self, param: nn.Parameter) -> None:
        # None: a use whose layer accumulated the gradient itself (an embedding keeps its
        # autograd edge to the weight, as its only differentiable input, and returns no
        # gradient there), so there is nothing more to add.
        if param.grad is not None:
            self._on_grad(param)

    def _on_grad(self, param: nn.Parameter, write: Callable | None = None, *operands) -> None:
        """A micro-batch's gradient of `param` arrived: `param.grad`, or, from a fusing layer,
        `operands` that `write` (one of FUSED_ACCUMULATIONS) adds into the buffer itself."""
        first = id(param) not in self._written
        self._written.add(id(param))
        if write is None:
            accumulate(param.main_grad, param.grad, self._grad_scale, first)
            param.grad = None
        else:
            write(param.main_grad, *operands, self._grad_scale, first)
        if not self.armed:
            return
        bucket = self._bucket_of[id(param)]
        if id(param) in bucket.seen:
            return
        bucket.seen.add(id(param))
        if len(bucket.seen) == len(bucket.params):
            self._launch(bucket)

    def _clear_unwritten(self, bucket: Bucket) -> None:
        """Zero what no gradient reached this step (a parameter no micro-batch used)."""
        if bucket.resident:
            for p in bucket.params:
                if id(p) not in self._written:
                    p.main_grad.zero_()

    def arm(self) -> None:
        """Called before the step's last backward: buckets reduce as soon as they are complete."""
        self.armed = True

    def _launch(self, bucket: Bucket) -> None:
        if bucket.launched:
            return
        bucket.launched = True
        self._clear_unwritten(bucket)
        if self.dp_size == 1:
            return
        with record_function("dp.reduce_launch"):
            self._launch_collective(bucket)

    def _launch_collective(self, bucket: Bucket) -> None:
        bucket.handle = dist.all_reduce(bucket.grad, group=self.dp_group, async_op=True)

    def finish(self) -> None:
        """Reduce every bucket not yet reduced and wait for all: the gradients are then the
        mean over dp (ZeRO-1 with reduce-scatter: in this rank's own chunks)."""
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
        self.armed = False

    def zero_grad(self) -> None:
        """Start a new step: buffers to be overwritten (accumulate.py), disarmed hooks."""
        self._written.clear()
        for bucket in self.buckets:
            bucket.seen.clear()
            bucket.launched = False
            bucket.handle = None
        self.armed = False

    # -- ownership: what this rank steps, counts in the norm, and gathers --------------------

    def owned_span(self, bucket: Bucket) -> tuple[int, int]:
        """The flat range of `bucket` this rank steps (zero_stage 0: all of it)."""
        return 0, bucket.grad.numel()

    def norm_span(self, bucket: Bucket) -> tuple[int, int]:
        """The flat range of `bucket` whose squares this rank adds to the global norm, each
        element on one dp rank. Zero 0: every rank holds the whole reduced buffer, so each
        counts its 1/dp of it (the norm's pass is shared, not run by dp rank 0 alone)."""
        n = bucket.grad.numel()
        return n * self.dp_rank // self.dp_size, n * (self.dp_rank + 1) // self.dp_size

    def grad_store(self, bucket: Bucket) -> tuple[torch.Tensor, int]:
        """Where the reduced gradient of `bucket` lives: (tensor, flat index of its element 0).
        Zero 0/1: the full buffer; ZeRO-2/3: this rank's shard."""
        return bucket.grad, 0

    def value_store(self, bucket: Bucket) -> tuple[torch.Tensor, int] | None:
        """Where the owned parameter values of `bucket` live, like `grad_store`; None: in the
        parameters themselves (every stage but ZeRO-3)."""
        return None

    def owned_pieces(self) -> list[OwnedPiece]:
        """The flat element ranges this rank steps, with their values and gradients."""
        return self._pieces(self.owned_span)

    def norm_pieces(self, counts: Callable[[nn.Parameter], bool]) -> list[OwnedPiece]:
        """The pieces whose squares this rank adds to a global norm (`norm_span`, parameters
        `counts` accepts): summed over the world, each element of the model counts once. For
        per-parameter statistics (reporting/layer_stats.py), not the step."""
        return [x for x in self._pieces(self.norm_span) if counts(x.param)]

    def _pieces(self, span_of: Callable[[Bucket], tuple[int, int]]) -> list[OwnedPiece]:
        out: list[OwnedPiece] = []
        for bucket in self.buckets:
            lo, hi = span_of(bucket)
            grads, g0 = self.grad_store(bucket)
            values = self.value_store(bucket)
            for p, off, start, end in bucket.ranges_in(lo, hi):
                if values is None:
                    value = p.detach().reshape(-1)[start - off : end - off]
                else:
                    value = values[0][start - values[1] : end - values[1]]
                grad = grads[start - g0 : end - g0]
                out.append(OwnedPiece(p, start - off, end - off, value, grad))
        return out

    def owned_grads(self) -> list[torch.Tensor]:
        """The flat gradient views this rank steps: one per bucket (what clipping scales)."""
        out = []
        for bucket in self.buckets:
            grads, g0 = self.grad_store(bucket)
            lo, hi = self.owned_span(bucket)
            out.append(grads[lo - g0 : hi - g0])
        return out

    def tied_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The gradient of a tied parameter that the tied group sums over its copies (the full
        one here; ZeRO-2/3: this rank's chunk, the same elements on every copy)."""
        return param.main_grad

    def local_grads(self, param: nn.Parameter) -> list[torch.Tensor]:
        """The reduced gradient elements of `param` this rank holds after `finish()`."""
        return [param.main_grad]

    def full_parameters(self) -> contextlib.AbstractContextManager:
        """A context in which every parameter holds its full value (ZeRO-3 gathers them;
        writes made inside are kept). For checkpoints, weight loading and checks."""
        return contextlib.nullcontext()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now for parameters and gradient buffers (each storage once)."""
        params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.params}
        grads = sum(b.grad.untyped_storage().nbytes() for b in self.buckets)
        grads += sum(b.shard.nbytes for b in self.buckets if b.shard is not None)
        return {"params": sum(params.values()), "grads": grads}

    def grad_norm_views(self, counts: Callable[[nn.Parameter], bool]) -> list[torch.Tensor]:
        """Flat gradient views whose squares this rank adds to the global norm: its
        `norm_span` of the parameters `counts` accepts, adjacent ones merged. Computed once."""
        if self._norm_views is None:
            views: list[torch.Tensor] = []
            for bucket in self.buckets:
                grads, g0 = self.grad_store(bucket)
                views += [grads[a - g0 : b - g0] for a, b in self._norm_spans(bucket, counts)]
            if views and views[0].device.type == "cpu":
                # The CPU's fp32 norm kernel sums sequentially (~1e-4 relative error on a few
                # million elements); over 16k-element rows it stays below 1e-7, and the fp32
                # pass costs ~1/15 of an fp64 one. A 2-D view is normed row by row in one call
                # (a call per 16k piece cost 3x the pass). GPU reductions are trees: no need.
                views = [rows for v in views for rows in _norm_rows(v)]
            self._norm_views = views
        return self._norm_views

    def _norm_spans(self, bucket: Bucket, counts: Callable[[nn.Parameter], bool]) -> list:
        """[start, end) flat ranges of `bucket` in this rank's norm, adjacent ones merged."""
        spans: list[list[int]] = []
        for p, _, start, end in bucket.ranges_in(*self.norm_span(bucket)):
            if not counts(p):
                continue
            if spans and spans[-1][1] == start:
                spans[-1][1] = end
            else:
                spans.append([start, end])
        return spans

    def gather_params(self) -> None:
        """After the optimizer step: nothing to do when every rank stepped everything."""

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params:
            for name in FUSED_ACCUMULATIONS:
                p.__dict__.pop(name, None)
