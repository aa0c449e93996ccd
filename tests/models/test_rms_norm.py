"""RMSNorm's autograd Function: its output and gradients against its first version's
arithmetic (kept here as the reference) within 1e-6, bf16 bitwise, and its op counts: the
forward's one squared copy and sum, no mean (it copies its divisor), no scalar copy, one matrix-vector product for the row
dots."""

from __future__ import annotations

import torch
from torch.profiler import profile

from nanotron_models.rms_norm_function import RMSNormFunction


def _reference(x, weight, eps, grad):
    """The first version's forward and hand-written backward (before the fused passes)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
    normed = (xf * rstd).to(x.dtype)
    out = weight * normed
    grad_weight = (grad * normed).flatten(0, -2).sum(0).to(weight.dtype)
    g = (grad * weight).float()
    nf = normed.float()
    grad_x = torch.addcmul(g, nf, (g * nf).mean(-1, keepdim=True), value=-1.0).mul_(rstd)
    return out, grad_x.to(grad.dtype), grad_weight


def _ours(x, weight, eps, grad):
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    out = RMSNormFunction.apply(x, weight, eps)
    out.backward(grad)
    return out.detach(), x.grad, weight.grad


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    grad = torch.randn(shape, generator=g).to(dtype)
    return x, weight, grad


def test_rms_norm_matches_its_first_version():
    for shape in [(64, 3, 256), (17, 2, 96)]:
        x, weight, grad = _inputs(shape, torch.float32)
        for got, want in zip(_ours(x, weight, 1e-5, grad), _reference(x, weight, 1e-5, grad)):
            scale = want.abs().max()
            assert (got - want).abs().max() <= 1e-6 * scale, (shape, (got - want).abs().max())
    x, weight, grad = _inputs((16, 2, 64), torch.bfloat16)  # other dtypes: unchanged
    for got, want in zip(_ours(x, weight, 1e-6, grad), _reference(x, weight, 1e-6, grad)):
        assert torch.equal(got, want)


def test_rms_norm_op_counts():
    x, weight, grad = _inputs((32, 2, 128), torch.float32)
    _ours(x, weight, 1e-5, grad)  # the constants made once
    with profile() as prof:
        _ours(x, weight, 1e-5, grad)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::_to_copy", 0) == 0, counts
    assert counts["aten::pow"] == 1 and counts.get("aten::mean", 0) == 0, counts
    assert counts["aten::mv"] == 1, counts
    # forward: normalise, scale; backward: grad * n, grad * weight (the row dots' mean reads
    # the first through mv; the input gradient's scale is a mul_)
    assert counts["aten::mul"] == 4, counts
