"""Column-parallel linear in REDUCE_SCATTER mode that keeps only its sequence shard
(Nanotron's `tp_recompute_allgather`).

The input arrives split along the sequence ([s/tp, b, in]) and is all-gathered before the
matmul. Autograd would keep the gathered [s, b, in] tensor for the weight gradient; this
function keeps the shard and gathers it again in the backward: tp times less activation
memory for one more all-gather per layer. The sums are the same as the plain path's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanotron_parallel.tensor_parallel.functional import _all_gather, _reduce_scatter
from nanotron_parallel.tensor_parallel.weight_grad import defer, linear_weight_grads


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _GatherRecomputeLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, native):
        ctx.group, ctx.has_bias, ctx.native, ctx.bias = group, bias is not None, native, bias
        ctx.weight = weight  # the parameter itself, for a deferred W (weight_grad.defer)
        ctx.save_for_backward(x, weight)  # the shard, not the gathered input
        return F.linear(_all_gather(x, group, dim=0), weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _reduce_scatter(grad_y.matmul(weight), ctx.group, 0, ctx.native)
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None, None, None
        has_bias, group = ctx.has_bias and ctx.needs_input_grad[2], ctx.group

        def compute():  # the gather is recomputed here, in W when deferred (see weight_grad.py)
            return linear_weight_grads(grad_y, _all_gather(x, group, dim=0), weight, has_bias)

        if defer((ctx.weight, ctx.bias) if has_bias else (ctx.weight,), compute):
            return grad_x, None, None, None, None
        grad_w, grad_b = compute()
        return grad_x, grad_w, grad_b, None, None


def gather_recompute_linear(x, weight, bias, group, native: bool | None = None) -> torch.Tensor:
    """`[s/tp, b, in]` -> `[s, b, out/tp]`, saving only the input shard for the backward
    (`native`: see `functional.native_reduce_scatter`)."""
    return _GatherRecomputeLinear.apply(x, weight, bias, group, native)
