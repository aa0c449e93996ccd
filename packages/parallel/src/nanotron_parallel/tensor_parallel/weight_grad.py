"""The linears' weight gradients: split from the backward (zero bubble), or accumulated in place.

A zero-bubble pipeline schedule (pipeline/zero_bubble.py) runs each micro-batch's backward as
B, whose input gradient the previous stage is waiting for, and its W when the schedule has a
slot to fill. The layers that own the big weight-gradient matmuls take part:

- while `weight_grad_split()` is active, the forwards of the column- and row-parallel linears
  (sync and async), the vocab-parallel embedding, the fused lm_head + cross-entropy and the
  RMSNorm build autograd functions whose backward can leave the weight gradient out;
- while `deferring(jobs)` is active (the B of one micro-batch), such a backward computes the
  input gradient only and appends to `jobs` a closure that computes the weight gradients from
  the tensors it keeps (`defer`); out of it, the same backward computes both at once;
- `run_weight_grads(jobs, extra)` (the W) runs the closures and accumulates every gradient
  through autograd (`torch.autograd.backward` on the parameters themselves), so the
  post-accumulate hooks of data parallelism fire as in a plain backward, only later.

The closure runs the same kernels on the same tensors as the fused backward, so B then W gives
bitwise the gradients of one backward. Any parameter without a split (a bias added outside a
linear, say) gets its gradient in B, kept by the schedule and accumulated in the same W call:
gradient accumulation, and the reduction that follows it, happens only in W.

Gradient-accumulation fusion: a linear whose weight has a data-parallel buffer
(`accumulate_grad_product`, set by nanotron_parallel.data_parallel) and no other use in the
graph (the caller's `fuse_accumulation`) builds `_FusedAccumulationLinear`. Its backward hands
the two factors of the weight gradient to the buffer, where one matmul writes or adds them
(data_parallel/accumulate.py): autograd never holds that gradient, nor copies it to the
weight's layout. Under a zero-bubble B the accumulation is the deferred closure, so it still
happens in W, and a W closure's gradients of such weights never pass through autograd either.

The state is process-wide (not thread-local): the CUDA autograd engine runs backwards on its
own threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

import nanotron_parallel.tensor_parallel.cpu_gemm as cpu_gemm

Job = tuple[Sequence[torch.Tensor], Callable[[], Sequence[torch.Tensor | None]]]


class _SplitState:
    enabled = False  # forwards build split-capable functions
    jobs: list[Job] | None = None  # the backward running now defers its W here


_STATE = _SplitState()


@contextlib.contextmanager
def weight_grad_split() -> Iterator[None]:
    """Forwards run inside this build layers whose backward can be split (a zero-bubble step)."""
    before, _STATE.enabled = _STATE.enabled, True
    try:
        yield
    finally:
        _STATE.enabled = before


def splitting() -> bool:
    return _STATE.enabled


@contextlib.contextmanager
def deferring(jobs: list[Job]) -> Iterator[list[Job]]:
    """Backwards run inside this (a B) append their weight-gradient closures to `jobs`."""
    before, _STATE.jobs = _STATE.jobs, jobs
    try:
        yield jobs
    finally:
        _STATE.jobs = before


def defer(params: Sequence[torch.Tensor], compute: Callable[[], Sequence]) -> bool:
    """Queue `compute` (returning one gradient per tensor of `params`) for the W of the
    backward running now; False when no B is deferring (the caller computes now).

    `params` must be the parameters as the forward received them (kept on ctx), not as
    `ctx.saved_tensors` gives them back: under activation checkpointing those are the
    recomputation's copies, and a gradient sent there would reach no parameter."""
    if _STATE.jobs is None:
        return False
    _STATE.jobs.append((params, compute))
    return True


def run_weight_grads(
    jobs: Sequence[Job], extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
) -> None:
    """The W of one micro-batch: run its closures, add up the gradients of each parameter
    (a tied weight used twice), and accumulate them, with `extra` (the gradients B computed
    for parameters without a split), in one autograd call so the parameters' hooks fire."""
    summed: dict[int, list] = {}
    # The closures compute gradients explicitly, as a backward does (autograd runs backward
    # functions without grad mode): no graph recorded around the layers' saved inputs, and an
    # async gather's copy into its output views happens in the mode the views were made in.
    with torch.no_grad():
        for params, compute in jobs:
            for p, g in zip(params, compute()):
                _add(summed, p, g)
    for p, g in extra:
        _add(summed, p, g)
    if summed:
        params, grads = zip(*summed.values())
        torch.autograd.backward(list(params), list(grads))


def _add(summed: dict[int, list], p: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is None:
        return
    entry = summed.get(id(p))
    if entry is None:
        summed[id(p)] = [p, g]
    else:
        entry[1] = entry[1] + g


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def linear_weight_grads(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dL/dW, dL/db) of y = x W^T + b: the weight gradient of every linear here."""
    grad_w = _flat(grad_y).t().matmul(_flat(x)).to(weight.dtype)
    return grad_w, (_flat(grad_y).sum(0) if has_bias else None)


def fuses_accumulation(weight: torch.Tensor, requested: bool, hook: str) -> bool:
    """Whether a layer asked to fuse (`requested`: its weight has no other use in the graph)
    can: a data-parallel buffer sits behind the weight (`hook`, one of the `accumulate_grad_*`
    methods it sets) and no compiled region is being traced (those keep autograd's ops)."""
    return (
        requested
        and weight.requires_grad
        and hasattr(weight, hook)
        and not torch.compiler.is_compiling()
    )


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        ctx.params = (weight,) if bias is None else (weight, bias)  # see `defer`
        return cpu_gemm.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias = ctx.saved_tensors
        grad_x = cpu_gemm.input_grad(grad_y, weight) if ctx.needs_input_grad[0] else None
        has_bias = bias is not None

        def compute():
            return linear_weight_grads(grad_y, x, weight, has_bias)[: len(ctx.params)]

        if defer(ctx.params, compute):
            return grad_x, None, None
        grad_w, grad_b = linear_weight_grads(grad_y, x, weight, has_bias)
        return grad_x, grad_w, grad_b


class _FusedAccumulationLinear(torch.autograd.Function):
    """F.linear whose weight gradient goes straight into the data-parallel gradient buffer
    (`accumulate_grad_product`, gradient-accumulation fusion) instead of through autograd;
    under a zero-bubble B it is deferred to the W like the split linear's."""

    @staticmethod
    def forward(ctx, x, weight, param_box, bias):
        ctx.save_for_backward(x, weight)
        (ctx.param,), ctx.has_bias = param_box, bias is not None
        ctx.bias_params = () if bias is None else (bias,)  # see `defer`
        return cpu_gemm.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = cpu_gemm.input_grad(grad_y, weight) if ctx.needs_input_grad[0] else None
        flat_grad_y = _flat(grad_y)

        def compute():  # the weight's gradient accumulated; the bias's returned
            ctx.param.accumulate_grad_product(flat_grad_y.t(), _flat(x))
            return (flat_grad_y.sum(0),) if ctx.has_bias else ()

        if defer(ctx.bias_params, compute):
            return grad_x, None, None, None
        grad_bias = compute()
        return grad_x, None, None, (grad_bias[0] if grad_bias else None)


def split_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fuse_accumulation: bool = False,
):
    """F.linear, whose weight gradient can be deferred while `weight_grad_split()` is on.
    With `fuse_accumulation` (the caller's weight has no other use in the graph: a second use
    would add its gradient after the bucket counted the weight as arrived) and a data-parallel
    buffer behind the weight, its gradient is accumulated there by the backward's matmul
    itself. Compiled regions keep F.linear."""
    if not torch.is_grad_enabled():
        return cpu_gemm.linear(x, weight, bias)
    if fuses_accumulation(weight, fuse_accumulation, "accumulate_grad_product"):
        # No autograd edge to the parameter (detached, and boxed: a tensor argument would be
        # one): its gradient never passes through autograd.
        return _FusedAccumulationLinear.apply(x, weight.detach(), (weight,), bias)
    if _STATE.enabled:
        return _SplitLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class _SplitEmbedding(torch.autograd.Function):
    """An embedding has no input gradient: its whole backward is W."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids, weight)
        ctx.params = (weight,)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        ids, weight = ctx.saved_tensors

        def compute():
            grad = torch.ops.aten.embedding_dense_backward(
                grad_out, ids, weight.shape[0], -1, False
            )
            return (grad.to(weight.dtype),)

        if defer(ctx.params, compute):
            return None, None
        return None, compute()[0]


class _FusedAccumulationEmbedding(torch.autograd.Function):
    """F.embedding whose weight gradient goes row by row into the data-parallel gradient
    buffer (`accumulate_grad_rows`) instead of through a table-sized autograd gradient; under
    a zero-bubble B it is deferred to the W. The weight stays an input (the only
    differentiable one: without it autograd would record no backward) and gets no gradient."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.param = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        param = ctx.param

        def compute():
            param.accumulate_grad_rows(ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]))
            return ()

        if not defer((), compute):
            compute()
        return None, None


def split_embedding(
    ids: torch.Tensor, weight: torch.Tensor, fuse_accumulation: bool = False
) -> torch.Tensor:
    """F.embedding, whose (weight) gradient can be deferred while `weight_grad_split()` is on.
    With `fuse_accumulation` (the weight has no other use in the graph, as for
    `split_linear`) and a data-parallel buffer behind the weight, its gradient is added there
    by the backward itself."""
    if not torch.is_grad_enabled():
        return F.embedding(ids, weight)
    if fuses_accumulation(weight, fuse_accumulation, "accumulate_grad_rows"):
        return _FusedAccumulationEmbedding.apply(ids, weight)
    if _STATE.enabled:
        return _SplitEmbedding.apply(ids, weight)
    return F.embedding(ids, weight)
