"""Single-device attention over blocks of global positions: what the three cp attentions call.

The contract with the models package. A kernel is
``kernel(q, k, v, q_index, k_index) -> out`` with q [s_q, b, h, d], k and v [s_k, b, kv, d]
(grouped-query attention: h a multiple of kv) and q_index [s_q], k_index [s_k] the int64
global positions of those queries and keys in the (packed) sequence. It lets query i see key j
when ``k_index[j] <= q_index[i]`` and the model's mask allows it; the model gives that mask as
``mask_fn(q_index, k_index) -> bool tensor`` broadcastable to [b, 1, s_q, s_k] (None: causal
only). Context-parallel code knows positions, never documents or windows. For contiguous
ranges with no mask (every call the all-gather and Ulysses make then) this is the ordinary
bottom-right causal kernel, which `causal_kernel` adapts.

The ring merges partial softmaxes, so it needs each block's log-sum-exp too, and its backward
needs the block gradients given the *final* output and log-sum-exp (the flash-attention
identity dS = P * (dP - rowsum(dO * O)) with P = exp(S - lse_final)). `block_forward` and
`block_backward` do both, choosing per block:

- `flash`: no mask and a block that is wholly visible or causal on its diagonal (which the
  ring knows from the layout, without looking at the indices): PyTorch's flash kernel, the one
  that returns the log-sum-exp (CPU: `_scaled_dot_product_flash_attention_for_cpu`; CUDA in
  fp16/bf16: `_scaled_dot_product_flash_attention`) and its backward;
- `math`: any mask, any dtype: scores materialised for the block, the reference.

A row with no visible key gives out = 0, lse = -inf, and zero (finite) gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

Kernel = Callable[..., torch.Tensor]  # (q, k, v, q_index, k_index) -> out
MaskFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (q_index, k_index) -> allowed
# Shown (q, k, q_index, k_index) of each block of scores an attention computes in its forward
# (a statistic of the scores, e.g. their maximum); returns nothing, changes nothing.
Observer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# How a block's keys sit against its queries when no mask_fn is given: all visible, or the
# diagonal block of a causal mask (s_q == s_k, same positions). None: read the indices.
BlockKind = Literal["full", "causal"] | None


def causal_kernel(kernel: Callable[..., torch.Tensor]) -> Kernel:
    """The contract's kernel from a bottom-right causal one ``kernel(q, k, v)``: right for
    the calls cp code makes without a mask (contiguous ranges ending together)."""

    def call(q, k, v, q_index, k_index):
        return kernel(q, k, v)

    return call


def observed_kernel(kernel: Kernel, observe: Observer) -> Kernel:
    """`kernel` that first shows `observe` its queries and keys (the all-gather and Ulysses
    attentions: each call is a block; a backward that re-runs the kernel shows them again)."""

    def call(q, k, v, q_index, k_index):
        observe(q, k, q_index, k_index)
        return kernel(q, k, v, q_index, k_index)

    return call


def allowed_keys(q_index: torch.Tensor, k_index: torch.Tensor, mask_fn: MaskFn | None):
    """Which keys each query sees: [s_q, s_k], or [b, 1, s_q, s_k] with a mask_fn."""
    allowed = k_index[None, :] <= q_index[:, None]
    return allowed if mask_fn is None else allowed & mask_fn(q_index, k_index)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[s, b, h, d] -> [b, kv, h/kv, s, d] (the query heads that share a kv head together)."""
    s, b, h, d = q.shape
    return q.permute(1, 2, 0, 3).reshape(b, kv_heads, h // kv_heads, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor):
    """Scaled scores [b, kv, g, s_q, s_k] in fp32 or wider, and the mask broadcast to them."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    qg = _grouped(q.to(dtype), k.shape[2])
    kg = k.to(dtype).permute(1, 2, 0, 3)[:, :, None]  # [b, kv, 1, s_k, d]
    scores = (qg @ kg.transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = allowed if allowed.dim() == 2 else allowed.unsqueeze(2)  # [b, 1, 1, s_q, s_k]
    return scores, mask


def reference_attention(q, k, v, q_index, k_index, mask_fn: MaskFn | None = None):
    """(out [s_q, b, h, d] in q's dtype, lse [b, h, s_q] in fp32, fp64 for fp64 inputs): the
    math implementation of the contract, differentiable (finite gradients for rows that see
    no key)."""
    scores, mask = _scores(q, k, allowed_keys(q_index, k_index, mask_fn))
    any_key = mask.any(-1)  # [.., s_q]
    scores = torch.where(mask, scores, float("-inf"))
    scores = torch.where(any_key[..., None], scores, 0.0)  # empty rows: a harmless softmax
    lse = torch.logsumexp(scores, -1)
    probs = torch.where(mask, torch.exp(scores - lse[..., None]), 0.0)
    out = probs @ v.to(scores.dtype).permute(1, 2, 0, 3)[:, :, None]  # [b, kv, g, s_q, d]
    b, kv, g, s_q, d = out.shape
    lse = torch.where(any_key, lse, float("-inf")).reshape(b, kv * g, s_q)
    return out.reshape(b, kv * g, s_q, d).permute(2, 0, 1, 3).to(q.dtype), lse


def reference_kernel(mask_fn: MaskFn | None = None) -> Kernel:
    """The contract's kernel, math implementation (tests, and a model without its own)."""
    return lambda q, k, v, q_index, k_index: reference_attention(
        q, k, v, q_index, k_index, mask_fn
    )[0]


def _use_flash(q: torch.Tensor, kind: BlockKind, mask_fn: MaskFn | None) -> bool:
    if mask_fn is not None or kind is None:
        return False
    if q.device.type == "cuda":
        return q.dtype in (torch.float16, torch.bfloat16)
    return q.device.type == "cpu"


def _heads_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[s, b, n, d] -> [b, heads, s, d], kv heads repeated for their query heads."""
    if t.shape[2] != heads:
        t = t.repeat_interleave(heads // t.shape[2], dim=2)
    return t.permute(1, 2, 0, 3)


def block_forward(q, k, v, q_index, k_index, kind: BlockKind, mask_fn: MaskFn | None):
    """(out [b, h, s_q, d], lse [b, h, s_q]) of one block, in fp32 or wider."""
    if _use_flash(q, kind, mask_fn):
        h = q.shape[2]
        q4, k4, v4 = q.permute(1, 2, 0, 3), _heads_first(k, h), _heads_first(v, h)
        if q.device.type == "cpu":
            op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        else:
            op = torch.ops.aten._scaled_dot_product_flash_attention
        out, lse = op(q4, k4, v4, 0.0, kind == "causal")[:2]
        wide = torch.promote_types(q.dtype, torch.float32)
        return out.to(wide), lse.to(wide)
    out, lse = reference_attention(q, k, v, q_index, k_index, mask_fn)
    wide = torch.promote_types(q.dtype, torch.float32)
    return out.permute(1, 2, 0, 3).to(wide), lse.to(wide)


def block_backward(grad, q, k, v, out, lse, q_index, k_index, kind, mask_fn):
    """Gradients (dq, dk, dv), shaped like q, k, v, of this block's share of an attention
    whose final output is `out` and log-sum-exp `lse` ([b, h, s_q, d] and [b, h, s_q]) for
    the output gradient `grad` ([b, h, s_q, d])."""
    if _use_flash(q, kind, mask_fn):
        return _flash_backward(grad, q, k, v, out, lse, kind == "causal")
    return _math_backward(grad, q, k, v, out, lse, allowed_keys(q_index, k_index, mask_fn))


def _flash_backward(grad, q, k, v, out, lse, causal: bool):
    h, kv = q.shape[2], k.shape[2]
    q4, k4, v4 = q.permute(1, 2, 0, 3), _heads_first(k, h), _heads_first(v, h)
    grad, out = grad.to(q.dtype), out.to(q.dtype)
    if q.device.type == "cpu":
        lse = lse.to(torch.promote_types(q.dtype, torch.float32)).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q4, k4, v4, out, lse, 0.0, causal
        )
    else:  # no dropout: the sequence offsets and the RNG state are unused
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q4, k4, v4, out, lse.float().contiguous(), empty, empty,
            q4.shape[2], k4.shape[2], 0.0, causal, empty, empty,
        )  # fmt: skip
    b, _, s_k, d = dk.shape
    dk, dv = (t.view(b, kv, h // kv, s_k, d).sum(2) for t in (dk, dv))
    return dq.permute(2, 0, 1, 3), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)


def _math_backward(grad, q, k, v, out, lse, allowed):
    scores, mask = _scores(q, k, allowed)
    b, kv, g, s_q, s_k = scores.shape
    wide = scores.dtype
    lse = lse.to(wide).view(b, kv, g, s_q, 1)
    finite = torch.isfinite(lse)
    probs = torch.where(mask & finite, torch.exp(scores - torch.where(finite, lse, 0.0)), 0.0)
    d_out = grad.to(wide).view(b, kv, g, s_q, -1)
    vg = v.to(wide).permute(1, 2, 0, 3)[:, :, None]  # [b, kv, 1, s_k, d]
    dv = (probs.transpose(-1, -2) @ d_out).sum(2)  # [b, kv, s_k, d]
    delta = (d_out * out.to(wide).view_as(d_out)).sum(-1, keepdim=True)
    d_scores = probs * (d_out @ vg.transpose(-1, -2) - delta) * q.shape[-1] ** -0.5
    kg = k.to(wide).permute(1, 2, 0, 3)[:, :, None]
    dq = (d_scores @ kg).reshape(b, kv * g, s_q, -1).permute(2, 0, 1, 3)
    qg = _grouped(q.to(wide), kv)
    dk = (d_scores.transpose(-1, -2) @ qg).sum(2).permute(2, 0, 1, 3)
    return dq, dk, dv.permute(2, 0, 1, 3)  # fp32 or wider: the ring sums them
