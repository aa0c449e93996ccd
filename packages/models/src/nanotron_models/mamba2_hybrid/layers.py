"""The hybrid's layers: each letter of the pattern is one residual layer, `x + mixer(norm(x))`.

Hidden states are sequence-first [s, b, h] as in every block of the project ([s/tp, b, h]
between tp regions in REDUCE_SCATTER mode). The Mamba-2 mixer is batch-first: its in_proj
(column-parallel, gathering the sequence under sequence parallel) runs sequence-first and its
outputs are transposed as views; the scan's output goes back by a view into the row-parallel
out_proj. Attention is our attention block (GQA, document masks; no rotary embedding, as
Nemotron-H), the MLP Nemotron-H's (up, relu2, down), the experts our MoE block with
Nemotron-H's router and relu2 experts (moe/; its shared expert this MLP, ungated).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanotron_parallel.sharding import ParamMeta, set_param_meta

from ..blocks import Attention, RMSNorm
from ..kv_cache import KVCache
from ..masks import DOCUMENT_IDS_KEY
from ..mixers import Mamba2Mixer, Mamba2State
from ..mixers.mamba2_cp import context_parallel_mix, local_reset_mask
from ..moe import MoEBlock
from .config import Mamba2HybridConfig
from .spec import HEAD_PARAMS, MAMBA2_HYBRID_TP_PLAN, mamba_sections

Batch = dict[str, torch.Tensor]
RESET_KEY = "ssm_reset_mask"  # [b, s] True where a token opens a document (stage.py)
PLAN = MAMBA2_HYBRID_TP_PLAN


class TPMamba2Mixer(Mamba2Mixer):
    """The Mamba-2 mixer at this rank's sizes (Mamba2Dims.tp_local): in_proj column-parallel by
    sections [z | x | B | C | dt], out_proj row-parallel; the conv, the per-head parameters and
    the gated norm hold this rank's heads and groups (marked for checkpoints and clipping)."""

    def __init__(self, c: Mamba2HybridConfig, group, mode, device=None, dtype=None):
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        full = c.mamba_dims
        super().__init__(full.tp_local(tp), use_kernels=True, device=device, dtype=dtype)
        f = {"device": device, "dtype": dtype}
        proj, conv = mamba_sections(c)
        h, inner = full.hidden_size, full.intermediate_size
        self.in_proj = PLAN.linear("mixer.in_proj")(
            h, full.in_proj_size, group, mode, bias=full.use_bias, sections=proj, **f
        )
        self.out_proj = PLAN.linear("mixer.out_proj")(
            inner, h, group, mode, bias=full.use_bias, **f
        )
        marks = {"conv1d.weight": ((full.conv_dim, 1, full.conv_kernel), conv),
                 "conv1d.bias": ((full.conv_dim,), conv), "norm.weight": ((inner,), None),
                 **{n: ((full.num_heads,), None) for n in HEAD_PARAMS}}  # fmt: skip
        for name, param in self.named_parameters():
            if name in marks:
                shape, sections = marks[name]
                set_param_meta(param, ParamMeta(shape, 0, sections, rank, tp))
        self.cp_group, self.cp_size, self.cp_native = None, 1, None

    def set_context_parallel(self, group, size: int, native_reduce_scatter: bool | None) -> None:
        """Hold 1/cp of every sequence (attention's zigzag chunks): the conv halo and the SSM
        state cross cp ranks (mixers/mamba2_cp.py) so the result equals one process's."""
        self.cp_group, self.cp_size, self.cp_native = group, size, native_reduce_scatter

    def forward_cp(self, x: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        """[L, b, h] of this cp rank's chunks -> [L, b, h]; `document_ids` the whole
        sequence's [b, S] (the batch keeps them whole under context parallel)."""
        rank = dist.get_rank(self.cp_group)
        reset = None if document_ids is None else local_reset_mask(document_ids, rank, self.cp_size)
        mixed = context_parallel_mix(self, x.transpose(0, 1), self.cp_group, reset,
                                     native_reduce_scatter=self.cp_native)  # fmt: skip
        return self.out_proj(mixed.transpose(0, 1))

    def forward_seq_first(
        self, x: torch.Tensor, reset_mask: torch.Tensor | None, state: Mamba2State | None
    ) -> tuple[torch.Tensor, Mamba2State]:
        """[s, b, h] -> ([s, b, h], the state after the sequence); `state` continues one."""
        z, xBC, dt = (t.transpose(0, 1) for t in self.project(x))  # views, [b, s, *]
        xBC, halo = self.conv(xBC, None if state is None else state.conv, reset_mask)
        y, ssm = self.scan(xBC, dt, reset_mask, None if state is None else state.ssm)
        mixed = self.gate_norm(y, z).to(x.dtype)  # [b, s, inner / tp]
        return self.out_proj(mixed.transpose(0, 1)), Mamba2State(halo, ssm)


class Relu2MLP(nn.Module):
    """Nemotron-H's MLP: down(relu(up(x))^2); up column-, down row-parallel. `size`: its
    width (default intermediate_size; an `E` layer's shared expert is one)."""

    def __init__(
        self, c: Mamba2HybridConfig, group, mode, device=None, dtype=None, size: int | None = None
    ):
        super().__init__()
        f = {"device": device, "dtype": dtype, "bias": c.mlp_bias}
        inner = c.intermediate_size if size is None else size
        self.up = PLAN.linear("mixer.up")(c.hidden_size, inner, group, mode, **f)
        self.down = PLAN.linear("mixer.down")(inner, c.hidden_size, group, mode, **f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


class HybridLayer(nn.Module):
    """One letter of the pattern: `norm` then `mixer` (Mamba-2, attention, MLP or experts),
    residual. `dispatcher`: how an `E` layer reaches its experts (expert parallel)."""

    def __init__(
        self, c: Mamba2HybridConfig, layer: int, group, mode, backend: str, device=None,
        dtype=None, dispatcher=None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.kind, self.layer = c.layer_kind(layer), layer
        sp = str(getattr(mode, "value", mode)).upper() == "REDUCE_SCATTER"
        fused = c._fused_rms_norm
        self.norm = RMSNorm(c.hidden_size, c.layer_norm_epsilon, group, sp, device, dtype, fused)
        if self.kind == "M":
            self.mixer: nn.Module = TPMamba2Mixer(c, group, mode, device, dtype)
        elif self.kind == "*":
            view = c.attention_view()
            self.mixer = Attention(view, layer, group, mode, None, backend, device, dtype)
        elif self.kind == "E":
            shared = Relu2MLP(c, group, mode, device, dtype, c.moe_shared_expert_intermediate_size)
            self.mixer = MoEBlock(c, layer, group, mode, dispatcher, device, dtype,
                                  variant=c.moe_variant, shared_expert=shared)  # fmt: skip
        else:
            self.mixer = Relu2MLP(c, group, mode, device, dtype)

    def forward(self, x: torch.Tensor, batch: Batch, *, decode_state=None) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "M" and self.mixer.cp_size > 1 and decode_state is None:
            return x + self.mixer.forward_cp(h, batch.get(DOCUMENT_IDS_KEY))
        if self.kind == "M":
            state = None if decode_state is None else decode_state.ssm.get(self.layer)
            out, new = self.mixer.forward_seq_first(h, batch.get(RESET_KEY), state)
            if decode_state is not None:
                decode_state.pending[self.layer] = new
            return x + out
        if self.kind == "*":
            kv: KVCache | None = None if decode_state is None else decode_state.kv
            docs = (
                batch.get(DOCUMENT_IDS_KEY) if self.mixer.document_masking and kv is None else None
            )
            pos = batch.get("position_ids")
            return x + self.mixer(h, pos, kv, batch.get("key_mask"), docs)
        return x + self.mixer(h)
