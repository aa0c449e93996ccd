"""The linears' forward and input-gradient GEMMs in fp32 on the CPU: oneDNN's matmul.

`F.linear` and `torch.mm` on a CPU tensor call the BLAS torch was built with (MKL in the
official x86 wheels). MKL picks its kernels by CPU vendor: on a non-Intel x86 CPU with AVX-512
(this project's test machines are AMD EPYC) it runs a generic path, while oneDNN, also inside
every x86 wheel, picks its kernels by the instructions the CPU has. Measured on such a
machine (`bench/step_costs.py`, the step's own shapes), oneDNN's matmul ran the forward
(`x W^T`) and input-gradient (`dy W`) GEMMs 8-25% faster at one thread and 1.2-2x at two; the
weight-gradient GEMM (`dy^T x`, written into the gradient buffer by `torch.mm(out=)` /
`addmm_`) was not faster through it and stays on the BLAS. `torch.ops.mkldnn._linear_pointwise`
is the entry point torch's own CPU inductor uses for a linear: `X W^T (+ B)`, with `W` given as
`[out, in]` (a transposed view for `dy W`).

The op has no autograd formula: these are called inside the linears' autograd Functions and
under `torch.no_grad`, never where autograd would differentiate them. Everything else (CUDA,
other dtypes, a compiled region, an empty input) takes the plain op. Results differ from the
BLAS's in the last bits (another summation order), like any two GEMM kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN_LINEAR = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available()
    else None
)

# The switch `bench/step_costs.py` turns off to time the BLAS against it in one process.
enabled = _ONEDNN_LINEAR is not None


def _use_onednn(a: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        enabled
        and a.device.type == "cpu"
        and a.dtype == torch.float32
        and weight.dtype == torch.float32
        and a.numel() > 0
        and not torch.compiler.is_compiling()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., in], weight [out, in]."""
    if _use_onednn(x, weight) and (bias is None or bias.dtype == torch.float32):
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def input_grad(
    grad_y: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """grad_y @ weight: a linear's input gradient, grad_y [..., out], weight [out, in]; with
    `out` (2-D grad_y), written there: in place by the plain op, copied from oneDNN's result
    (the op has no out= form)."""
    if _use_onednn(grad_y, weight):
        result = _ONEDNN_LINEAR(grad_y, weight.t(), None, "none", [], "")
        return result if out is None else out.copy_(result)
    if out is not None:
        return torch.mm(grad_y, weight, out=out)
    return grad_y.matmul(weight)
