"""Qwen3-Next's full-attention layer and its zero-centred norms.

GatedAttention is our attention block (GQA, the attention kernels, document masks, context
parallel, KV cache: blocks.Attention) with Qwen3-Next's differences, as HF's
`Qwen3NextAttention` computes them:
- q_proj emits, per head, the query then an output gate of the same size; the fused
  projection `qkv` is [q+gate | k | v] (sections cut over tp part by part, so a rank keeps
  whole heads with their gates);
- q and k are RMS-normalised per head (weights of head_dim, zero-centred, replicated over tp:
  their gradients summed over tp as a sequence-parallel norm's);
- rotary on the first `rotary_dim` dims of each head only (partial_rotary_factor);
- the attention output is multiplied by sigmoid(gate) before o_proj.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.tensor_parallel import copy_to_tp

from ..blocks import Attention, RMSNorm
from ..kv_cache import KVCache
from ..rotary import RotaryTable, apply_rotary
from .spec import QWEN3_NEXT_TP_PLAN as PLAN


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + weight), in fp32 then cast back, as HF's Qwen3NextRMSNorm."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight): the weight starts at 0 (the init spec's zeros), and
    weight decay pulls it towards a scale of 1. Sequence parallel as RMSNorm."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.group) if self.sequence_parallel else self.weight
        return zero_centred_rms_norm(x, weight, self.eps)


class HeadNorm(nn.Module):
    """The zero-centred RMSNorm of each q or k head (last dim head_dim). Each tp rank normalises
    its own heads, so the replicated weight's gradient is summed over tp (copy_to_tp)."""

    def __init__(self, size: int, eps: float, group, device=None, dtype=None) -> None:
        super().__init__()
        self.eps, self.group = eps, group
        self.weight = nn.Parameter(torch.zeros(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = dist.get_world_size(self.group) if self.group is not None else 1
        weight = copy_to_tp(self.weight, self.group) if tp > 1 else self.weight
        return zero_centred_rms_norm(x, weight, self.eps)


class GatedAttention(Attention):
    """See the module docstring; `config` a Qwen3NextConfig."""

    def __init__(self, config, layer: int, group, mode, rotary: RotaryTable, backend: str,
                 device=None, dtype=None):  # fmt: skip
        nn.Module.__init__(self)
        c, tp = config, dist.get_world_size(group)
        self.layer, self.rotary, self.backend, self.group = layer, rotary, backend, group
        d, h = c.head_dim, c.hidden_size
        self.head_dim, self.rotary_dim = d, c.rotary_dim
        self.n_heads, self.n_kv = c.num_attention_heads // tp, c.num_key_value_heads // tp
        q2, kv = 2 * c.num_attention_heads * d, c.num_key_value_heads * d
        f = {"device": device, "dtype": dtype}
        self.qkv = PLAN.linear("mixer.qkv")(
            h, q2 + 2 * kv, group, mode, bias=c.attention_bias, sections=[q2, kv, kv], **f
        )
        self.o_proj = PLAN.linear("mixer.o_proj")(
            c.num_attention_heads * d, h, group, mode, bias=c.attention_bias, **f
        )
        self.q_norm = HeadNorm(d, c.rms_norm_eps, group, **f)
        self.k_norm = HeadNorm(d, c.rms_norm_eps, group, **f)
        self.cp_group, self.cp_size, self.cp_native, self.cp_attention = None, 1, None, "allgather"
        self.use_rope, self.window = True, None
        self.document_masking = c.document_masking
        self.fused_rotary = False

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        key_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        fused = self.qkv(x)  # [s, b, (2 heads + 2 kv) * d / tp]
        s, b, d = fused.shape[0], fused.shape[1], self.head_dim
        qg, k, v = fused.split([2 * self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q, gate = qg.view(s, b, self.n_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(s, b, self.n_kv, d))
        cos, sin = self.cos_sin(s, x, position_ids, kv_cache)
        q, k = (self._rotate_part(t, cos, sin) for t in (q, k))
        out = self.attend(q, k, v.view(s, b, self.n_kv, d), kv_cache, key_mask, doc_ids)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(s, b, self.n_heads * d))

    def _rotate_part(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rotary(t, cos, sin)
        return torch.cat((apply_rotary(t[..., :r], cos, sin), t[..., r:]), dim=-1)
