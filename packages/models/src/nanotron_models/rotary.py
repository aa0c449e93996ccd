"""Rotary position embeddings (RoPE), rotate-half layout, with optional Llama-3 frequency scaling.

We use the same "rotate half" convention as Hugging Face's Llama (the two halves of each head
dimension form the rotated pairs), so HF q/k projection weights load without any permutation.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, Llama-3 scaled when `scaling` is given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryTable:
    """cos/sin lookup for positions; the table grows on demand and is kept per device.

    Not an nn.Module buffer on purpose: it is derived from the config, never trained nor saved.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        interpolation: float | None = None,
    ):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # Position interpolation: position p is rotated as p / interpolation.
        self.interpolation = interpolation
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._last: tuple | None = None  # (weak ref to position ids, dtype, (cos, sin))
        self._last_range: tuple | None = None  # ((offset, length, device, dtype), table, out)

    def _table(self, length: int, device: torch.device, dtype: torch.dtype):
        key = (device, dtype)
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < length:
            size = max(length, 2 * cached[0].shape[0] if cached is not None else length)
            pos = torch.arange(size, device=device, dtype=torch.float32)
            if self.interpolation is not None:
                pos = pos / self.interpolation
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cached = (emb.cos().to(dtype), emb.sin().to(dtype))
            self._tables[key] = cached
        return cached

    def cos_sin(
        self,
        position_ids: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [*position_ids.shape, head_dim]. `length` (> every position) saves
        reading the largest position on the host, a device sync: training passes it."""
        if length is None:
            length = int(position_ids.max()) + 1
        cos, sin = self._table(length, device, dtype)
        return cos[position_ids], sin[position_ids]

    def cos_sin_range(
        self, offset: int, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, 1, 1, head_dim] of positions offset .. offset + length - 1, the
        same for every sequence (batches without position ids): slices of the table, the rows
        a gather of those positions would copy, with no position tensor and no gather. Kept
        for the last (offset, length), so the layers and micro-batches of a step share them."""
        cos, sin = self._table(offset + length, device, dtype)
        key = (offset, length, device, dtype)
        compiling = torch.compiler.is_compiling()  # compiled code: plain slices, no cache
        last = None if compiling else self._last_range
        if last is not None and last[0] == key and last[1] is cos:
            return last[2]
        end = offset + length
        out = (cos[offset:end, None, None, :], sin[offset:end, None, None, :])
        if not compiling:
            self._last_range = (key, cos, out)
        return out

    def cos_sin_of(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*position_ids.shape, head_dim] computed from the positions themselves:
        no table, so no host read of the largest position (positions restarting per document
        can exceed any table a sample's length bounds). The same values as the table (the
        same fp32 products); kept for the last position tensor, so the layers of a
        micro-batch compute them once."""
        compiling = torch.compiler.is_compiling()  # inside a compiled layer: plain ops, no cache
        last = None if compiling else self._last
        if last is not None and last[0]() is position_ids and last[1] == dtype:
            return last[2]
        pos = position_ids.to(torch.float32)
        if self.interpolation is not None:
            pos = pos / self.interpolation
        freqs = pos[..., None] * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        out = (emb.cos().to(dtype), emb.sin().to(dtype))
        if not compiling:
            self._last = (weakref.ref(position_ids), dtype, out)
        return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [..., heads, head_dim]; cos/sin broadcast over the heads dim."""
    return x * cos + rotate_half(x) * sin


def rotate_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (rotated) and v [s, b, heads, d] from the fused projection [s, b, n_q + 2 n_kv, d]:
    what `apply_rotary` on its q and k parts computes, in one autograd Function."""
    return _RotaryQKV.apply(qkv, cos, sin, n_q, n_kv)


class _RotaryQKV(torch.autograd.Function):
    """Rotation of q and k written as x*cos -/+ (other half)*sin in place (three passes
    instead of five, no rotated copy), and a backward that writes the gradients of q, k and v
    into one tensor: autograd's version zero-fills slices, adds them up and concatenates the
    parts twice. Saves only cos and sin."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, n_q: int, n_kv: int):
        half, n_qk = qkv.shape[-1] // 2, n_q + n_kv
        x = qkv[:, :, :n_qk]
        out = torch.empty_like(qkv)
        rotated = out[:, :, :n_qk]
        torch.mul(x, cos, out=rotated)
        rotated[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)
        rotated[..., half:].addcmul_(x[..., :half], sin[..., half:])
        out[:, :, n_qk:].copy_(qkv[:, :, n_qk:])
        ctx.save_for_backward(cos, sin)
        ctx.n_q, ctx.n_kv = n_q, n_kv
        return out.split([n_q, n_kv, n_kv], dim=2)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        cos, sin = ctx.saved_tensors
        n_q, n_kv = ctx.n_q, ctx.n_kv
        half = grad_q.shape[-1] // 2
        grad = grad_q.new_empty((*grad_q.shape[:2], n_q + 2 * n_kv, grad_q.shape[-1]))
        # d(x1 c - x2 s, x2 c + x1 s) / d(x1, x2): (g1 c + g2 s, g2 c - g1 s)
        for g_out, g in ((grad_q, grad[:, :, :n_q]), (grad_k, grad[:, :, n_q : n_q + n_kv])):
            torch.mul(g_out, cos, out=g)
            g[..., :half].addcmul_(g_out[..., half:], sin[..., half:])
            g[..., half:].addcmul_(g_out[..., :half], sin[..., :half], value=-1.0)
        grad[:, :, n_q + n_kv :].copy_(grad_v)
        return grad, None, None, None, None
