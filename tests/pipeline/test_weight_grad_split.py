"""The B/W split of every layer with weights: B (input gradients, weight gradients queued)
then W (the queue run) gives bitwise the gradients of one fused backward, in one process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nanotron_models.blocks import RMSNorm
from nanotron_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_linear_cross_entropy,
)
from nanotron_parallel.tensor_parallel.async_linear import async_column_linear, async_row_linear
from nanotron_parallel.tensor_parallel.gather_recompute import gather_recompute_linear
from nanotron_parallel.tensor_parallel.weight_grad import (
    deferring,
    run_weight_grads,
    weight_grad_split,
)
from nanotron_parallel.testing import shared_default_group

S, B, H, V = 6, 2, 8, 16


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    with shared_default_group():
        yield


def _linear(mode, bias):
    def build():
        layer = ColumnParallelLinear(H, 12, None, mode, bias=bias)
        return layer, lambda x: layer(x)

    return build


def _row(mode):
    def build():
        layer = RowParallelLinear(H, 12, None, mode, bias=True)
        return layer, lambda x: layer(x)

    return build


def _fn(fn, bias=True):
    def build():
        layer = torch.nn.Linear(H, 12, bias=bias)
        return layer, lambda x: fn(x, layer)

    return build


def _embedding():
    layer = VocabParallelEmbedding(V, H, None, "ALL_REDUCE")
    ids = torch.tensor([[1, 3, 3, 0, 15, 7], [2, 2, 9, 9, 1, 0]]).t()  # a repeated id sums
    return layer, lambda x: layer(ids) * x


def _norm(sequence_parallel):
    def build():
        layer = RMSNorm(H, 1e-5, None, sequence_parallel)
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
        return layer, lambda x: layer(x)

    return build


def _fused_loss():
    layer = torch.nn.Linear(H, V, bias=False)
    targets = torch.arange(S * B) % V
    weights = torch.full((S * B,), 1.0 / (S * B))

    def run(x):
        loss, _ = vocab_parallel_linear_cross_entropy(
            x.flatten(0, 1), layer.weight, targets, weights, None, z_coefficient=1e-3
        )
        return loss

    return layer, run


def _recomputed():
    """A norm and a linear under activation checkpointing: the forward runs again in B, and
    W must still reach the parameters themselves (not the recomputation's copies)."""
    norm, linear = RMSNorm(H, 1e-5), ColumnParallelLinear(H, 12, None, "ALL_REDUCE", bias=True)
    both = torch.nn.ModuleList([norm, linear])

    def run(x):
        return checkpoint(lambda t: linear(norm(t)), x, use_reentrant=False)

    return both, run


LAYERS = {
    "recomputed_norm_and_linear": _recomputed,
    "column_all_reduce": _linear("ALL_REDUCE", True),
    "column_reduce_scatter": _linear("REDUCE_SCATTER", False),
    "row_all_reduce": _row("ALL_REDUCE"),
    "row_reduce_scatter": _row("REDUCE_SCATTER"),
    "column_async": _fn(lambda x, m: async_column_linear(x, m.weight, m.bias, None)),
    "column_async_recompute": _fn(
        lambda x, m: async_column_linear(x, m.weight, m.bias, None, None, True)
    ),
    "row_async": _fn(lambda x, m: async_row_linear(x, m.weight, None), bias=False),
    "column_gather_recompute": _fn(lambda x, m: gather_recompute_linear(x, m.weight, m.bias, None)),
    "embedding": _embedding,
    "rms_norm": _norm(False),
    "rms_norm_sequence_parallel": _norm(True),
    "fused_linear_cross_entropy": _fused_loss,
}


def _run(build, split: bool):
    torch.manual_seed(0)
    layer, fn = build()
    x = torch.randn(S, B, H, requires_grad=True)
    with weight_grad_split():
        y = fn(x)
        grad_y = torch.randn_like(y) if y.dim() else None
        params = [p for p in layer.parameters()]
        if not split:
            torch.autograd.backward(y, grad_y)
            return x.grad, [p.grad for p in params], 0
        jobs: list = []
        with deferring(jobs):
            got = torch.autograd.grad(y, [x, *params], grad_y, allow_unused=True)
        assert all(p.grad is None for p in params)  # B accumulated nothing
        extra = [(p, g) for p, g in zip(params, got[1:]) if g is not None]
        run_weight_grads(jobs, extra)
        return got[0], [p.grad for p in params], len(jobs)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_b_then_w_equals_the_fused_backward(name: str) -> None:
    grad_x, grads, _ = _run(LAYERS[name], split=False)
    split_x, split_grads, n_jobs = _run(LAYERS[name], split=True)
    assert n_jobs >= 1  # the weight gradient really was deferred to W
    assert torch.equal(grad_x, split_x)
    assert len(grads) == len(split_grads) and grads
    for want, got in zip(grads, split_grads):
        assert want is not None and torch.equal(want, got)
