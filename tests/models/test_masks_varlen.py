"""flash-attn's varlen path for document masks, checked on the CPU against SDPA with the
explicit mask: a stand-in `flash_attn` module (per-sequence SDPA, flash-attn's signature and
window semantics) proves the glue this project writes (cu_seqlens from document ids, the
flattening of rows, the window's translation), which is all that differs from flash-attn."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from nanotron_models.masks import AttentionMask, document_ids, masked_attention, varlen_bounds


def _window_causal(s: int, window: tuple[int, int]) -> torch.Tensor:
    rel = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    allowed = rel >= 0
    if window[0] >= 0:
        allowed &= rel <= window[0]
    return allowed


def _sdpa(q, k, v, window):  # [b, s, h, d] as flash-attn takes them
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    mask = _window_causal(q.shape[1], window)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size):
    assert causal and torch.equal(cu_q, cu_k) and max_q == max_k and cu_q.dtype == torch.int32
    bounds = cu_q.tolist()
    assert max_q == max(b - a for a, b in zip(bounds, bounds[1:]))
    parts = [
        _sdpa(q[None, a:b], k[None, a:b], v[None, a:b], window_size)[0]
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(parts)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = _varlen
    module.flash_attn_func = lambda q, k, v, causal, window_size: _sdpa(q, k, v, window_size)
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def test_cu_seqlens_of_rows_flattened_one_after_another() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])  # row 2 starts mid-document
    cu, longest = varlen_bounds(document_ids(positions))
    assert cu.tolist() == [0, 3, 5, 6, 8, 12] and cu.dtype == torch.int32 and longest == 4


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("documents", [True, False])
def test_varlen_equals_the_explicit_mask(fake_flash_attn, window, documents) -> None:
    torch.manual_seed(0)
    s, b, h, kv, d = 12, 2, 4, 2, 8
    positions = torch.tensor(
        [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]
    )
    mask = AttentionMask(document_ids(positions) if documents else None, window)
    q = torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(s, b, kv, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    index = torch.arange(s)
    outs, grads = [], []
    for backend in ("flash_attn", "sdpa"):
        out = masked_attention(q, k, v, index, index, mask, backend, whole=True)
        outs.append(out)
        grads.append(
            torch.autograd.grad(
                (out * torch.linspace(-1, 1, out.numel()).view_as(out).double()).sum(), (q, k, v)
            )
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
