"""Muon's two pieces of math, written as `torch.optim.Muon` (torch 2.13) computes them.

`orthogonalise` is the quintic Newton-Schulz iteration of Keller Jordan's Muon, op for op as
`torch.optim._muon._zeropower_via_newtonschulz` (in bfloat16, the wide orientation, the
Frobenius-norm scaling), so that one process gives torch's numbers; it is copied rather than
imported because torch's function is private. It may run in float32 instead (`muon_ns_dtype`):
bfloat16 keeps 8 bits, so two runs whose gradients differ by float32 rounding (another
parallel layout sums in another order) round some elements of the update to neighbouring
bfloat16 values, 2^-8 apart; float32 keeps such runs within ~1e-7 of each other. `lr_ratio` is `adjust_lr_fn`'s factor.
"""

from __future__ import annotations

import math

import torch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_STEPS = 5
DEFAULT_EPS = 1e-7
ADJUST_LR_FNS = ("original", "match_rms_adamw")


def orthogonalise(
    grad: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """~U V^T of `grad` = U S V^T (singular values pushed into ~[0.5, 1.5]), in `dtype`
    (torch's: bfloat16)."""
    a, b, c = coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The learning-rate factor of a rows x cols matrix: `original` (Keller Jordan's,
    sqrt(max(1, rows/cols))) or `match_rms_adamw` (Moonshot's, 0.2 sqrt(max(rows, cols)))."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {list(ADJUST_LR_FNS)}, got {adjust_lr_fn!r}")
