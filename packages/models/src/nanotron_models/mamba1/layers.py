"""The Mamba-1 family's layer: `x + mixer(RMSNorm(x))`, the mixer at this rank's tp sizes.

Hidden states are sequence-first [s, b, h] as in every block of the project ([s/tp, b, h]
between tp regions in REDUCE_SCATTER mode); the mixer is batch-first, reached by transposed
views of in_proj's output (column-parallel, gathering the sequence under sequence parallel)
and back into the row-parallel out_proj. With `residual_in_fp32` the residual stream is fp32
whatever model.dtype (Hugging Face's MambaBlock and mamba_ssm: the norm reads it cast to the
model's dtype, the mixer's output is added to it in fp32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.sharding import ParamMeta, set_param_meta
from nanotron_parallel.tensor_parallel import copy_to_tp, reduce_from_tp

from ..blocks import RMSNorm
from ..errors import ModelConfigError
from ..mamba2_hybrid.layers import RESET_KEY
from ..mixers import Mamba1Mixer, Mamba1State
from .config import MambaConfig
from .spec import MAMBA1_TP_PLAN

Batch = dict[str, torch.Tensor]
PLAN = MAMBA1_TP_PLAN


class TPMamba1Mixer(Mamba1Mixer):
    """The Mamba-1 mixer at this rank's sizes (Mamba1Dims.tp_local): in_proj column-parallel by
    sections [x | z], out_proj row-parallel, x_proj's partial products all-reduced; the conv,
    dt_proj, A_log and D hold this rank's channels (marked for checkpoints and clipping)."""

    def __init__(self, c: MambaConfig, group, mode, device=None, dtype=None):
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        full = c.mamba_dims
        super().__init__(full.tp_local(tp), bool(c.ssm("use_fast_path")), device, dtype)
        f = {"device": device, "dtype": dtype}
        h, i = full.hidden_size, full.intermediate_size
        r, n, k = full.time_step_rank, full.state_size, full.conv_kernel
        self.in_proj = PLAN.linear("mixer.in_proj")(
            h, 2 * i, group, mode, bias=full.use_bias, sections=(i, i), **f
        )
        self.out_proj = PLAN.linear("mixer.out_proj")(i, h, group, mode, bias=full.use_bias, **f)
        marks = {"conv1d.weight": ((i, 1, k), 0), "conv1d.bias": ((i,), 0),
                 "x_proj.weight": ((r + 2 * n, i), 1), "dt_proj.weight": ((i, r), 0),
                 "dt_proj.bias": ((i,), 0), "A_log": ((i, n), 0), "D": ((i,), 0)}  # fmt: skip
        for name, param in self.named_parameters():
            if name in marks:
                shape, dim = marks[name]
                set_param_meta(param, ParamMeta(shape, dim, None, rank, tp))
        self.group, self.tp = group, tp

    def reduce_x_proj(self, partial: torch.Tensor) -> torch.Tensor:
        """x_proj contracts over every rank's channels: sum the partial products (forward), and
        since dt, B and C then feed each rank's own channels, sum their gradients too."""
        if self.tp == 1:
            return partial
        return copy_to_tp(reduce_from_tp(partial, self.group), self.group)

    def set_context_parallel(self, group, size: int, native_reduce_scatter) -> None:
        if size > 1:
            raise ModelConfigError(
                "parallelism.context_parallel_size > 1 is not supported for Mamba-1 layers "
                "(is_mamba_config) yet"
            )

    def forward_seq_first(
        self, x: torch.Tensor, reset_mask: torch.Tensor | None, state: Mamba1State | None
    ) -> tuple[torch.Tensor, Mamba1State]:
        """[s, b, h] -> ([s, b, h], the state after the sequence); `state` continues one."""
        xi, z = (t.transpose(0, 1) for t in self.project(x))  # views, [b, s, I / tp]
        xi, halo = self.conv(xi, None if state is None else state.conv, reset_mask)
        y, ssm = self.scan(xi, z, reset_mask, None if state is None else state.ssm)
        return self.out_proj(y.to(x.dtype).transpose(0, 1)), Mamba1State(halo, ssm)


class Mamba1Layer(nn.Module):
    """`norm` then the Mamba-1 `mixer`, with the residual (fp32 under residual_in_fp32)."""

    kind = "M"  # what HybridStage asks a layer: a state-space one (resets, decoding state)

    def __init__(
        self, c: MambaConfig, layer: int, group, mode, backend: str, device=None, dtype=None
    ) -> None:
        nn.Module.__init__(self)  # not super(): stage.py's subclass also derives HybridLayer
        self.layer, self.residual_in_fp32 = layer, c.residual_in_fp32
        sp = str(getattr(mode, "value", mode)).upper() == "REDUCE_SCATTER"
        eps, fused = c.rms_norm_eps, c._fused_rms_norm
        self.norm = RMSNorm(c.d_model, eps, group, sp, device, dtype, fused)
        self.mixer = TPMamba1Mixer(c, group, mode, device, dtype)

    def forward(self, x: torch.Tensor, batch: Batch, *, decode_state=None) -> torch.Tensor:
        h = self.norm(x.to(self.norm.weight.dtype))
        state = None if decode_state is None else decode_state.ssm.get(self.layer)
        out, new = self.mixer.forward_seq_first(h, batch.get(RESET_KEY), state)
        if decode_state is not None:
            decode_state.pending[self.layer] = new
        if self.residual_in_fp32:
            x = x.to(torch.promote_types(x.dtype, torch.float32))
        return x + out


class CastRMSNorm(RMSNorm):
    """The final norm: reads an fp32 residual stream cast to the model's dtype, as each
    layer's norm does."""

    def forward(self, x: torch.Tensor, batch: Batch | None = None) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype), batch)
