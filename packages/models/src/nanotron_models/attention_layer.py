"""The Llama family's attention layer (also the hybrid families' `*` layer): the fused qkv
projection, rotary positions (none on a NoPE layer), the layer's mask beyond causality
(documents, a sliding window), the keys and values of the other context-parallel ranks, and the
KV cache when decoding. The kernels are attention.py's; hidden states are [s, b, h] as in
blocks.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.context_parallel import context_parallel_attention

from .attention import attention, resolve_backend
from .config import LlamaConfig
from .init import LLAMA_TP_PLAN  # which layer is split how: built here, cut by init
from .kv_cache import KVCache
from .masks import AttentionMask, index_kernel, masked_attention, shared_mask
from .probes import ATTN_MAX_LOGIT, max_attention_logit, max_logit_observer
from .rotary import RotaryTable, apply_rotary, rotate_qkv


class Attention(nn.Module):
    q_multiplier = 1.0  # µP's attention 1/d (parametrization.py; LlamaStage sets it)
    probe_stat, probe = ATTN_MAX_LOGIT, None  # a detail step's max logit (probes.py)

    def __init__(
        self,
        config: LlamaConfig,
        layer: int,
        group,
        mode,
        rotary: RotaryTable,
        backend: str,
        device=None,
        dtype=None,
    ):
        super().__init__()
        c, tp = config, dist.get_world_size(group)
        self.layer, self.rotary, self.backend, self.group = layer, rotary, backend, group
        self.head_dim = c.head_dim
        self.n_heads, self.n_kv = c.num_attention_heads // tp, c.n_kv_heads // tp
        d, h = c.head_dim, c.hidden_size
        qkv_out = (c.num_attention_heads + 2 * c.n_kv_heads) * d
        sections = [c.num_attention_heads * d, c.n_kv_heads * d, c.n_kv_heads * d]
        bias = c.attention_bias
        self.qkv = LLAMA_TP_PLAN.linear("attn.qkv")(
            h, qkv_out, group, mode, bias=bias, device=device, dtype=dtype, sections=sections
        )
        self.o_proj = LLAMA_TP_PLAN.linear("attn.o_proj")(
            c.num_attention_heads * d,
            h,
            group,
            mode,
            bias=c.o_proj_bias,
            device=device,
            dtype=dtype,
        )
        self.cp_group, self.cp_size, self.cp_native, self.cp_attention = None, 1, None, "allgather"
        # The family's attention (config.py's DecoderConfig): NoPE layers, windows, documents.
        self.use_rope, self.window = c.uses_rope(layer), c.sliding_window(layer)
        self.document_masking = c.document_masking
        self.fused_rotary = getattr(c, "_fused_rotary_emb", True)

    def set_context_parallel(
        self, group, size: int, native_reduce_scatter: bool | None, attention: str | None = None
    ) -> None:
        """Hold 1/cp of every sequence (the layout of nanotron_parallel.context_parallel):
        keys and values come from the other cp ranks of `group` by `attention` (allgather,
        ring or ulysses; None keeps the current one), positions are global."""
        self.cp_group, self.cp_size, self.cp_native = group, size, native_reduce_scatter
        self.cp_attention = attention or self.cp_attention

    def mask(self, doc_ids: torch.Tensor | None, decoding: bool) -> AttentionMask | None:
        """This layer's mask beyond causality (None: plain causal). Decoding runs one document
        per sequence: only the window applies there."""
        docs = doc_ids if self.document_masking and not decoding else None
        if docs is None and self.window is None:
            return None
        return shared_mask(docs, self.window)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        key_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, (heads + 2 kv) * d / tp], the full sequence
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.n_heads + 2 * self.n_kv, self.head_dim)
        q, k, v = self._rotate(qkv, x, position_ids, kv_cache)
        if self.q_multiplier != 1.0:  # µP's q.k / d: the kernels divide by sqrt(d) again
            q = q * self.q_multiplier
        out = self.attend(q, k, v, kv_cache, key_mask, doc_ids)
        return self.o_proj(out.reshape(s, b, self.n_heads * self.head_dim))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        key_mask: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal attention of q, k, v [s, b, heads, d] -> [s, b, heads, d]: through the cache
        when decoding, the cp group's keys under context parallel, the layer's mask."""
        s, device = q.shape[0], q.device
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        backend = resolve_backend(self.backend, device)
        mask = self.mask(doc_ids, kv_cache is not None)
        if self.cp_size > 1 and kv_cache is None and key_mask is None:
            kernel = index_kernel(mask, backend, attention)
            # a detail step: the max logit of each block of scores the attention computes
            observe = max_logit_observer(self.probe, mask) if self.probe is not None else None
            out = context_parallel_attention(
                q, k, v, self.cp_group, kernel, self.cp_native,
                method=self.cp_attention, mask_fn=mask, observe=observe,
            )  # fmt: skip
        elif mask is not None:
            s_k = k.shape[0]
            k_index = torch.arange(s_k, device=device)
            q_index = k_index[s_k - s :]
            whole = kv_cache is None
            out = masked_attention(q, k, v, q_index, k_index, mask, backend, key_mask, whole)
        else:
            out = attention(q, k, v, backend, key_mask)  # [s, b, heads, d]
        if self.probe is not None and self.cp_size == 1 and kv_cache is None:  # a detail step
            self.probe.copy_(torch.maximum(self.probe, max_attention_logit(q, k, mask)))
        return out

    def _rotate(self, qkv, x, position_ids, kv_cache):
        """q, k (rotated, unless a NoPE layer) and v [s, b, heads, d]."""
        if not self.use_rope:
            return qkv.split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        cos, sin = self.cos_sin(qkv.shape[0], x, position_ids, kv_cache)
        if torch.compiler.is_compiling() or not self.fused_rotary:  # plain ops
            # One rotation for q and k together: they are adjacent in the fused projection.
            qk, v = qkv.split([self.n_heads + self.n_kv, self.n_kv], dim=2)
            q, k = apply_rotary(qk, cos, sin).split([self.n_heads, self.n_kv], dim=2)
            return q, k, v
        return rotate_qkv(qkv, cos, sin, self.n_heads, self.n_kv)

    def cos_sin(self, s: int, x, position_ids, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin broadcasting over [s, b, heads, rotary dims] for this forward's tokens."""
        offset = kv_cache.offset if kv_cache is not None else 0
        if position_ids is None:  # positions offset .. offset + s - 1: slices of the table
            cos, sin = self.rotary.cos_sin_range(offset, s, x.device, x.dtype)
        elif kv_cache is None:  # training, evaluation
            # From the positions themselves, once per micro-batch: no host read of the largest
            cos, sin = self.rotary.cos_sin_of(position_ids, x.dtype)  # [b, s, d]
            cos, sin = cos.transpose(0, 1)[:, :, None, :], sin.transpose(0, 1)[:, :, None, :]
        else:  # [b, s] -> cos/sin [s, b, 1, d]
            # Under cp every position is below the whole sequence's length: no host read.
            length = s * self.cp_size if self.cp_size > 1 else None
            cos, sin = self.rotary.cos_sin(position_ids.transpose(0, 1), x.device, x.dtype, length)
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        return cos, sin
