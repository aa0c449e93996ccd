"""The linears' forward and input-gradient GEMMs through oneDNN on the CPU in fp32
(tensor_parallel/cpu_gemm.py): the same values as torch's BLAS within fp32 rounding, the
plain op wherever oneDNN is not used, and the training linear really running it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from nanotron_parallel.tensor_parallel import cpu_gemm
from nanotron_parallel.tensor_parallel.weight_grad import split_linear

ONEDNN_OP = "mkldnn::_linear_pointwise"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _onednn_calls(fn) -> int:
    with profile() as prof:
        fn()
    return sum(ev.name == ONEDNN_OP for ev in prof.events())


def test_onednn_is_used_on_this_cpu():
    # torch's x86 and aarch64 CPU wheels ship oneDNN; without it every call takes F.linear.
    assert cpu_gemm.enabled


@pytest.mark.parametrize("bias", [False, True])
def test_linear_and_input_grad_values(bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 96, generator=g)
    w = torch.randn(80, 96, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    dy = torch.randn(64, 3, 80, generator=g)
    assert _onednn_calls(lambda: cpu_gemm.linear(x, w, b)) == 1
    assert _rel(cpu_gemm.linear(x, w, b), F.linear(x, w, b)) < 1e-6
    assert _onednn_calls(lambda: cpu_gemm.input_grad(dy, w)) == 1
    assert _rel(cpu_gemm.input_grad(dy, w), dy.matmul(w)) < 1e-6
    out = torch.empty(64, 96)
    flat = dy.reshape(-1, 80)[:64]
    assert cpu_gemm.input_grad(flat, w, out=out) is out
    assert _rel(out, flat @ w) < 1e-6
    xt = torch.randn(96, 64, generator=g).t()  # a transposed (non-contiguous) input
    assert _rel(cpu_gemm.linear(xt, w), F.linear(xt, w)) < 1e-6


def test_plain_op_elsewhere():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 16, generator=g)
    x16 = torch.randn(4, 16, generator=g).bfloat16()
    assert _onednn_calls(lambda: cpu_gemm.linear(x16, w.bfloat16())) == 0
    assert torch.equal(cpu_gemm.linear(x16, w.bfloat16()), F.linear(x16, w.bfloat16()))
    empty = torch.empty(0, 16)
    assert cpu_gemm.linear(empty, w).shape == (0, 8)
    assert cpu_gemm.input_grad(torch.empty(0, 8), w).shape == (0, 16)
    out16 = torch.empty(4, 16, dtype=torch.bfloat16)
    g16 = torch.randn(4, 8, generator=g).bfloat16()
    assert cpu_gemm.input_grad(g16, w.bfloat16(), out=out16) is out16  # torch.mm(out=)
    assert torch.equal(out16, g16 @ w.bfloat16())
    x = torch.randn(4, 16, generator=g)
    cpu_gemm.enabled = False
    try:
        assert _onednn_calls(lambda: cpu_gemm.linear(x, w)) == 0
        assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))
    finally:
        cpu_gemm.enabled = True


def test_training_linear_runs_forward_and_input_grad_through_it():
    """split_linear under a zero-bubble split (the autograd Function path): forward and input
    gradient by oneDNN, the weight gradient by the BLAS; gradients as autograd's F.linear."""
    from nanotron_parallel.tensor_parallel.weight_grad import weight_grad_split

    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 2, 48, generator=g, requires_grad=True)
    w = torch.randn(40, 48, generator=g, requires_grad=True)
    dy = torch.randn(32, 2, 40, generator=g)
    ref_x = x.detach().clone().requires_grad_()
    ref_w = w.detach().clone().requires_grad_()
    F.linear(ref_x, ref_w).backward(dy)

    def step():
        with weight_grad_split():
            y = split_linear(x, w)
        y.backward(dy)

    assert _onednn_calls(step) == 2
    assert _rel(x.grad, ref_x.grad) < 1e-6
    assert _rel(w.grad, ref_w.grad) < 1e-6
