"""Mamba-1's selective scan (S6) in plain PyTorch, and mamba_ssm's kernel where it applies.

The recurrence, per channel d and state n (A is [d, n]: every channel decays each state at
its own rate, unlike Mamba-2's one scalar per head):

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * x_t        y_t = C_t . h_t + D * x_t

`selective_scan` evaluates it as a first-order linear recurrence h_t = a_t h_{t-1} + b_t, in
chunks: inside a chunk a Hillis-Steele parallel prefix (log2(chunk) elementwise steps, each
combining (a, b) pairs: only products of decays <= 1, so nothing overflows, unlike the
cumulative-sum form that divides by exp of the summed log-decay), then the chunk's last state
is carried into the next chunk. The result equals the sequential loop up to rounding.
A document start (`reset_mask`) sets that token's decay to 0: the state restarts there.

Kernels: on CUDA with `mamba_ssm` installed, a scan without resets or an initial state runs
its fused `selective_scan_fn`; everything else (the CPU, documents, a carried state) runs the
PyTorch form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanotron_parallel.compile_boundary import eager_under_compile

from .ssd_scan import compute_dtype

Tensor = torch.Tensor

try:  # the optional CUDA kernel
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
except ImportError:  # pragma: no cover - depends on the environment
    selective_scan_fn = None


def linear_recurrence(a: Tensor, b: Tensor, chunk_size: int = 64) -> Tensor:
    """Every h_t of h_t = a_t * h_{t-1} + b_t (h_{-1} = 0) along dim 1 of [batch, l, ...]."""
    out, carry = [], None
    for start in range(0, a.shape[1], chunk_size):
        decay, state = _prefix_scan(
            a[:, start : start + chunk_size], b[:, start : start + chunk_size]
        )
        if carry is not None:
            state = state + decay * carry[:, None]
        carry = state[:, -1]
        out.append(state)
    return torch.cat(out, dim=1)


def _prefix_scan(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Hillis-Steele inclusive scan of the pairs (a, b) under (a1, b1) . (a2, b2) = (a1 a2,
    a2 b1 + b2): returns (the products of a up to t, the states from a zero start)."""
    step = 1
    while step < a.shape[1]:
        b = torch.cat((b[:, :step], b[:, step:] + a[:, step:] * b[:, :-step]), dim=1)
        a = torch.cat((a[:, :step], a[:, step:] * a[:, :-step]), dim=1)
        step *= 2
    return a, b


@eager_under_compile  # loops over chunks and prefix steps: eager under model.compile
def selective_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    reset_mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    use_kernels: bool = True,
) -> tuple[Tensor, Tensor]:
    """y [b, l, d] (compute dtype) and the final state [b, d, n] of the scan.

    x, dt [b, l, d] (dt after its bias and softplus), A [d, n] (negative), B, C [b, l, n],
    D [d] the skip, z [b, l, d] the gate (y * SiLU(z)), reset_mask [b, l] True where a
    document starts, initial_state [b, d, n] the state before the first token.
    """
    if _kernel_ok(x, use_kernels, reset_mask, initial_state):
        y, last = selective_scan_fn(
            x.transpose(1, 2), dt.transpose(1, 2), A.float(), B.transpose(1, 2),
            C.transpose(1, 2), None if D is None else D.float(),
            None if z is None else z.transpose(1, 2), return_last_state=True,
        )  # fmt: skip
        return y.transpose(1, 2).to(compute_dtype(x.dtype)), last
    cdt = compute_dtype(x.dtype)
    xc, dt = x.to(cdt), dt.to(cdt)
    decay = torch.exp(dt[..., None] * A.to(cdt))  # [b, l, d, n]
    if reset_mask is not None:
        decay = decay * (~reset_mask.to(torch.bool)).to(cdt)[:, :, None, None]
    inputs = (dt * xc)[..., None] * B.to(cdt)[:, :, None, :]
    if initial_state is not None:
        first = inputs[:, :1] + decay[:, :1] * initial_state.to(cdt)[:, None]
        inputs = torch.cat((first, inputs[:, 1:]), dim=1)
    states = linear_recurrence(decay, inputs, chunk_size)
    y = torch.einsum("bldn,bln->bld", states, C.to(cdt))
    if D is not None:
        y = y + xc * D.to(cdt)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y, states[:, -1]


def _kernel_ok(x: Tensor, use_kernels: bool, reset_mask, initial_state) -> bool:
    return (
        use_kernels
        and selective_scan_fn is not None
        and x.is_cuda
        and reset_mask is None
        and initial_state is None
    )
