"""Attention masks by global token index: documents of a packed sequence, sliding windows.

A mask is a function of WHICH tokens a block of queries and a block of keys are: their global
positions in the (packed) sequence, `q_index` [s_q] and `k_index` [s_k]. Causality is
`k_index <= q_index`; a sliding window of W adds `q_index - k_index < W` (a query sees itself
and the W-1 keys before it: flash-attn's `window_size=(W-1, 0)`, Hugging Face's
`sliding_window=W`); document masking adds "same document", read from the micro-batch's
full-sequence document ids. Written by index, the same mask serves one device (indices
0..S-1), a KV cache (queries at the end) and context parallel (each rank's chunks), whose code
knows nothing of documents or windows: it is handed `mask_fn`.

Document ids come from the data: position ids restart at 0 at each document start (Nanotron's
convention, `return_positions`), so document d of a row is the tokens from its d-th zero on
(`document_ids`). A row's first token opens a document whatever its position (a sample that
starts inside a document).

Kernels. `masked_attention` runs flex attention when asked for (`flex`): compiled, block-sparse
(128x128 blocks the mask empties are skipped, which is where packed short documents and
windows save work). PyTorch has no flex backward on the CPU, so there it serves only
gradient-free calls (evaluation, generation). `flash_attn` (CUDA with flash-attn installed:
Nanotron's default `flash_attention_2`) runs whole sequences through flash-attn's varlen kernel,
each document one sequence of the flattened batch (`cu_seqlens` from the document ids, built
once per micro-batch with one host read of the longest document, as every varlen caller
needs), the window as flash-attn's `window_size`. Every other call runs SDPA with the explicit
boolean mask. All give the same values (tests/models/test_qwen2.py, test_masks_varlen.py).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nanotron_parallel.compile_boundary import prepare_compile

DOCUMENT_IDS_KEY = "document_ids"


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, S] document index of each token from position ids restarting at 0 per document."""
    starts = position_ids == 0
    starts[:, 0] = True
    return starts.cumsum(dim=1)


@dataclass
class AttentionMask:
    """The mask of one layer on one micro-batch: `document_ids` [b, S] (None: no document
    masking) and `window` (None: no sliding window), beyond causality."""

    document_ids: torch.Tensor | None = None
    window: int | None = None
    # flex block masks of the whole sequence (q and k indices 0..S-1), by (s, device):
    # built once per micro-batch and mask, shared by the layers (`shared_mask`)
    blocks: dict = field(default_factory=dict, repr=False, compare=False)

    def __call__(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """`mask_fn(q_index, k_index)`: True where query i may see key j, shape
        [b or 1, 1, s_q, s_k]."""
        rel = q_index[:, None] - k_index[None, :]
        allowed = rel >= 0
        if self.window is not None:
            allowed = allowed & (rel < self.window)
        allowed = allowed[None, None]
        if self.document_ids is not None:
            doc = self.document_ids
            same = doc[:, q_index][:, :, None] == doc[:, k_index][:, None, :]
            allowed = allowed & same[:, None]
        return allowed

    def varlen_bounds(self, s: int, device) -> tuple[torch.Tensor, int]:
        """flash-attn varlen's (cu_seqlens, longest document), once per micro-batch."""
        key = ("varlen", s, device)
        if key not in self.blocks:
            self.blocks[key] = varlen_bounds(self.document_ids)
        return self.blocks[key]

    def mask_mod(self, q_index: torch.Tensor, k_index: torch.Tensor):
        """flex attention's mask_mod over this mask's global indices."""
        doc, window = self.document_ids, self.window

        def mod(b, h, q, k):
            qi, ki = q_index[q], k_index[k]
            ok = ki <= qi
            if window is not None:
                ok = ok & (qi - ki < window)
            if doc is not None:
                ok = ok & (doc[b, qi] == doc[b, ki])
            return ok

        return mod


_SHARED: dict = {}  # window -> (weak reference to the document ids, AttentionMask)


def shared_mask(doc_ids: torch.Tensor | None, window: int | None) -> AttentionMask:
    """The mask of `window` over these document ids, one object per micro-batch: the layers of
    a forward (and its recomputation) share it and its flex block mask."""
    hit = _SHARED.get(window)
    if hit is not None and hit[0]() is doc_ids:
        return hit[1]
    mask = AttentionMask(doc_ids, window)
    _SHARED[window] = (weakref.ref(doc_ids) if doc_ids is not None else _none, mask)
    return mask


def _none() -> None:
    return None


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    mask: AttentionMask,
    backend: str = "sdpa",
    key_mask: torch.Tensor | None = None,
    whole: bool = False,
) -> torch.Tensor:
    """Attention of q [s_q, b, h, d] on k, v [s_k, b, kv, d] (sequence-first, GQA) under
    `mask` at the given global indices; `key_mask` [b, s_k] (True = a real token) hides
    decoding's left padding; `whole`: the indices are 0..S-1 for both (the flex block mask is
    then kept on the mask for the other layers). Returns [s_q, b, h, d]."""
    if backend == "flash_attn" and key_mask is None and whole:
        return _flash_varlen(q, k, v, mask)
    if backend == "flex" and key_mask is None:
        if q.device.type == "cuda":
            return _flex(q, k, v, q_index, k_index, mask, whole=whole)
        if not _grad(q, k, v):  # the CPU's flex checks requires_grad even under no_grad
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            return _flex(qd, kd, vd, q_index, k_index, mask, whole=whole)
    allowed = mask(q_index, k_index)
    if key_mask is not None:  # padding rows still see themselves: finite, unused outputs
        diagonal = (q_index[:, None] == k_index[None, :])[None, None]
        allowed = (allowed & key_mask[:, None, None, :]) | diagonal
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    gqa = qb.shape[1] != kb.shape[1]
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, enable_gqa=gqa)
    return out.permute(2, 0, 1, 3)


def _flash_varlen(q, k, v, mask: AttentionMask) -> torch.Tensor:
    """flash-attn over whole sequences: documents as the varlen kernel's sequences."""
    import flash_attn

    window = (mask.window - 1, 0) if mask.window is not None else (-1, -1)
    if mask.document_ids is None:  # a window alone: the batched kernel
        qb, kb, vb = (t.transpose(0, 1) for t in (q, k, v))
        out = flash_attn.flash_attn_func(qb, kb, vb, causal=True, window_size=window)
        return out.transpose(0, 1)
    s, b = q.shape[0], q.shape[1]
    cu_seqlens, longest = mask.varlen_bounds(s, q.device)
    # [s, b, h, d] -> [b * s, h, d]: row after row, so each document is one contiguous run
    flat = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
    out = flash_attn.flash_attn_varlen_func(
        *flat, cu_seqlens, cu_seqlens, longest, longest, causal=True, window_size=window
    )
    return out.view(b, s, *out.shape[1:]).transpose(0, 1)


def varlen_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [n_docs + 1], longest document) of the batch's rows flattened one
    after the other: a document starts where the id changes or a row starts."""
    b, s = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = starts.flatten().nonzero().flatten()
    end = torch.tensor([b * s], device=first.device, dtype=first.dtype)
    cu_seqlens = torch.cat((first, end)).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())  # the kernel's grid size: a host read


def _grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _flex(
    q, k, v, q_index, k_index, mask: AttentionMask, compiled: bool = True, whole: bool = False
) -> torch.Tensor:
    """flex attention with the block mask of `mask` (`compiled=False`: PyTorch's unfused
    reference, which materialises the scores; for tests)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, s_q, s_k = q.shape[1], q.shape[0], k.shape[0]
    batch = b if mask.document_ids is not None else None
    key = (s_q, s_k, q.device)
    block = mask.blocks.get(key) if whole else None
    if block is None:
        block = create_block_mask(
            mask.mask_mod(q_index, k_index), batch, None, s_q, s_k, device=q.device
        )
        if whole:
            mask.blocks[key] = block
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    gqa = qb.shape[1] != kb.shape[1]
    kernel = _compiled_flex() if compiled else flex_attention
    out = kernel(qb, kb, vb, block_mask=block, enable_gqa=gqa)
    return out.permute(2, 0, 1, 3)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    prepare_compile()
    return torch.compile(flex_attention, dynamic=False)


def index_kernel(mask: AttentionMask | None, backend: str, attention):
    """The kernel context-parallel code calls, `kernel(q, k, v, q_index, k_index)`: the
    model's mask at those global indices, or plain causal attention (`attention`, bottom-right
    aligned, exact for contiguous ranges) when there is no mask."""

    def kernel(q, k, v, q_index, k_index):
        if mask is None:
            return attention(q, k, v, backend=backend)
        return masked_attention(q, k, v, q_index, k_index, mask, backend)

    return kernel
