"""Qwen3-Next's decoder layer: `x + mixer(input_norm(x))`, then `x + mlp(post_attn_norm(x))`,
the mixer Gated DeltaNet (G) or gated attention (*), the feed-forward our MoE block (E) or a
dense SwiGLU MLP (-); both norms zero-centred (attention.py).

Hidden states are sequence-first [s, b, h] ([s/tp, b, h] between tp regions in REDUCE_SCATTER
mode). The Gated DeltaNet mixer (mixers/gated_deltanet.py) is batch-first: its column-parallel
input projections run sequence-first (gathering the sequence under sequence parallel) and
their outputs are transposed as views; its output goes back by a view into the row-parallel
out_proj, as the Mamba-2 layers of the Mamba-2 hybrid do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanotron_parallel.sharding import ParamMeta, set_param_meta
from nanotron_parallel.tensor_parallel import copy_to_tp

from ..blocks import MLP
from ..kv_cache import KVCache
from ..mamba2_hybrid.layers import RESET_KEY, HybridLayer
from ..masks import DOCUMENT_IDS_KEY
from ..mixers.gated_deltanet import GatedDeltaNetDims, GatedDeltaNetMixer, GatedDeltaNetState
from ..mixers.gated_deltanet_cp import context_parallel_mix
from ..mixers.mamba2_cp import local_reset_mask
from ..mixers.ssd_scan import compute_dtype
from ..moe import MoEBlock
from ..rotary import RotaryTable
from .attention import GatedAttention, ZeroCentredRMSNorm
from .config import Qwen3NextConfig
from .spec import HEAD_PARAMS, QWEN3_NEXT_TP_PLAN, gdn_sizes

Batch = dict[str, torch.Tensor]
PLAN = QWEN3_NEXT_TP_PLAN


def gdn_dims(c: Qwen3NextConfig) -> GatedDeltaNetDims:
    return GatedDeltaNetDims(
        hidden_size=c.hidden_size, num_key_heads=c.linear_num_key_heads,
        num_value_heads=c.linear_num_value_heads, key_head_dim=c.linear_key_head_dim,
        value_head_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
        chunk_size=c.linear_chunk_size, norm_eps=c.rms_norm_eps,
    )  # fmt: skip


class TPGatedDeltaNetMixer(GatedDeltaNetMixer):
    """The Gated DeltaNet mixer at this rank's sizes (GatedDeltaNetDims.tp_local): its key heads'
    block of in_proj_qkvz and in_proj_ba rows (column-parallel), its slice of each conv section,
    its value heads' A_log and dt_bias, out_proj row-parallel. The gated norm's weight [d_v] is
    shared by every head: its gradient, from this rank's heads, is summed over tp."""

    def __init__(self, c: Qwen3NextConfig, group, mode, device=None, dtype=None):
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        full = gdn_dims(c)
        super().__init__(full.tp_local(tp), use_kernels=True, device=device, dtype=dtype)
        f = {"device": device, "dtype": dtype, "bias": False}
        g, h = gdn_sizes(c), c.hidden_size
        self.group, self.tp = group, tp
        self.in_proj_qkvz = PLAN.linear("mixer.in_proj_qkvz")(h, g["qkvz"], group, mode, **f)
        self.in_proj_ba = PLAN.linear("mixer.in_proj_ba")(h, g["ba"], group, mode, **f)
        self.out_proj = PLAN.linear("mixer.out_proj")(g["value"], h, group, mode, **f)
        conv = (g["key"], g["key"], g["value"])
        marks = {"conv1d.weight": ((g["conv"], 1, c.linear_conv_kernel_dim), conv),
                 **{n: ((c.linear_num_value_heads,), None) for n in HEAD_PARAMS}}  # fmt: skip
        for name, param in self.named_parameters():
            if name in marks:
                shape, sections = marks[name]
                set_param_meta(param, ParamMeta(shape, 0, sections, rank, tp))
        self.cp_group, self.cp_size, self.cp_native = None, 1, None

    def set_context_parallel(self, group, size: int, native_reduce_scatter: bool | None) -> None:
        """Hold 1/cp of every sequence (attention's zigzag chunks): the conv halo and the
        delta rule's affine state maps cross cp ranks (mixers/gated_deltanet_cp.py) so the
        result equals one process's."""
        self.cp_group, self.cp_size, self.cp_native = group, size, native_reduce_scatter

    def forward_cp(self, x: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        """[L, b, h] of this cp rank's chunks -> [L, b, h]; `document_ids` the whole
        sequence's [b, S] (the batch keeps them whole under context parallel)."""
        rank = dist.get_rank(self.cp_group)
        reset = None if document_ids is None else local_reset_mask(document_ids, rank, self.cp_size)
        mixed = context_parallel_mix(self, x.transpose(0, 1), self.cp_group, reset,
                                     native_reduce_scatter=self.cp_native)  # fmt: skip
        return self.out_proj(mixed.transpose(0, 1))

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """As GatedDeltaNetMixer.project, the leading dims read from the projections' output:
        under sequence parallel the column-parallel layers gather the sequence of `hidden`."""
        d, r = self.dims, self.dims.heads_per_key
        qkvz = self.in_proj_qkvz(hidden).unflatten(-1, (d.num_key_heads, -1))
        dv = r * d.value_head_dim
        q, k, v, z = qkvz.split([d.key_head_dim, d.key_head_dim, dv, dv], dim=-1)
        b, a = self.in_proj_ba(hidden).unflatten(-1, (d.num_key_heads, 2 * r)).split([r, r], -1)
        qkv = torch.cat((q.flatten(-2), k.flatten(-2), v.flatten(-2)), dim=-1)
        z = z.reshape(*qkvz.shape[:-2], d.num_value_heads, d.value_head_dim)
        return qkv, z, b.flatten(-2), a.flatten(-2)

    def gate_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return super().gate_norm(o, z)
        norm = self.norm  # GatedRMSNorm's maths with its weight read through copy_to_tp
        dtype, cdt = z.dtype, compute_dtype(z.dtype)
        y = o.to(dtype).to(cdt)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps)
        weight = copy_to_tp(norm.weight, self.group)
        return (weight * y.to(dtype) * F.silu(z.to(cdt))).to(dtype).flatten(-2)

    def forward_seq_first(
        self, x: torch.Tensor, reset_mask: torch.Tensor | None, state: GatedDeltaNetState | None
    ) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """[s, b, h] -> ([s, b, h], the state after the sequence); `state` continues one."""
        qkv, z, b, a = (t.transpose(0, 1) for t in self.project(x))  # views, [b, s, *]
        qkv, halo = self.conv(qkv, None if state is None else state.conv, reset_mask)
        o, rec = self.scan(qkv, b, a, reset_mask, None if state is None else state.recurrent)
        mixed = self.gate_norm(o, z).to(x.dtype)  # [b, s, value_dim / tp]
        return self.out_proj(mixed.transpose(0, 1)), GatedDeltaNetState(halo, rec)


class Qwen3NextLayer(HybridLayer):
    """One decoder layer (see the module docstring). `kind` is its mixer's letter (G or *),
    `ffn` its feed-forward's (E or -); `mixer` is where the hybrid stage finds the attention
    or the state-carrying mixer."""

    def __init__(
        self, c: Qwen3NextConfig, layer: int, group, mode, backend: str, rotary: RotaryTable,
        device=None, dtype=None, dispatcher=None,
    ) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.kind, self.ffn, self.layer = c.mixer_kind(layer), c.ffn_kind(layer), layer
        sp = str(getattr(mode, "value", mode)).upper() == "REDUCE_SCATTER"
        eps, fused, h = c.rms_norm_eps, c._fused_rms_norm, c.hidden_size
        kw = {"device": device, "dtype": dtype}
        self.input_norm = ZeroCentredRMSNorm(h, eps, group, sp, fused=fused, **kw)
        if self.kind == "G":
            self.mixer: nn.Module = TPGatedDeltaNetMixer(c, group, mode, **kw)
        else:
            self.mixer = GatedAttention(c, layer, group, mode, rotary, backend, **kw)
        self.post_attn_norm = ZeroCentredRMSNorm(h, eps, group, sp, fused=fused, **kw)
        if self.ffn == "E":
            self.mlp: nn.Module = MoEBlock(c, layer, group, mode, dispatcher, **kw)
        else:
            self.mlp = MLP(c, group, mode, **kw)

    def set_context_parallel(self, group, size: int, native_reduce_scatter, attention) -> None:
        """Attention reaches the other cp ranks' keys and values, Gated DeltaNet passes its
        conv halo and state maps; the MoE balance statistics sum over the cp ranks' tokens."""
        if self.kind == "*":
            self.mixer.set_context_parallel(group, size, native_reduce_scatter, attention)
        else:
            self.mixer.set_context_parallel(group, size, native_reduce_scatter)
        if self.ffn == "E":
            self.mlp.set_context_parallel(group, size)

    def forward(self, x: torch.Tensor, batch: Batch, *, decode_state=None) -> torch.Tensor:
        h = self.input_norm(x)
        if self.kind == "G" and self.mixer.cp_size > 1 and decode_state is None:
            out = self.mixer.forward_cp(h, batch.get(DOCUMENT_IDS_KEY))
        elif self.kind == "G":
            state = None if decode_state is None else decode_state.ssm.get(self.layer)
            out, new = self.mixer.forward_seq_first(h, batch.get(RESET_KEY), state)
            if decode_state is not None:
                decode_state.pending[self.layer] = new
        else:
            kv: KVCache | None = None if decode_state is None else decode_state.kv
            docs = (
                batch.get(DOCUMENT_IDS_KEY) if self.mixer.document_masking and kv is None else None
            )
            pos = batch.get("position_ids")
            out = self.mixer(h, pos, kv, batch.get("key_mask"), docs)
        x = x + out
        return x + self.mlp(self.post_attn_norm(x))
