"""The Mamba-2 mixer: Hugging Face `Mamba2Mixer`'s parameters and values, in plain PyTorch.

    in_proj: hidden -> [z | x | B | C | dt]  (sizes I, I, G*N, G*N, H; I = H * head_dim)
    conv1d:  depthwise causal conv (kernel K) + SiLU over [x | B | C]
    dt:      softplus(dt + dt_bias), clamped to time_step_limit;  A = -exp(A_log)
    scan:    the SSD recurrence (ssd_scan.py) with the skip D
    norm:    RMSNorm per group of I / G channels of y * SiLU(z) (HF's MambaRMSNormGated)
    out_proj: I -> hidden

Tensors are batch-first ([b, l, hidden]), as in Hugging Face and mamba_ssm. The mixer is built
from *local* sizes (`Mamba2Dims.tp_local`): under tensor parallel each rank holds H/tp heads
and G/tp groups, their rows of in_proj and channels of the conv (mamba2_tp.py slices them),
and out_proj is row-parallel: the per-rank outputs sum to the full one, its bias added once.
Kernels: forward's conv and scan run mamba_ssm / causal_conv1d on CUDA when installed (see
ssd_scan.py), PyTorch otherwise and always on the CPU; `step` is always PyTorch.

Decoding state per layer (`Mamba2State`): the conv's last K-1 inputs [b, conv_dim, K-1] and the
SSM state [b, H, head_dim, N] (fp32), constant in the sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .ssd_scan import Tensor, causal_conv, compute_dtype, ssd_scan


@dataclass(frozen=True)
class Mamba2Dims:
    """A mixer's sizes (full, or one tp rank's from `tp_local`) and options (HF's meanings)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int = 4
    chunk_size: int = 256
    use_conv_bias: bool = True
    use_bias: bool = False
    norm_eps: float = 1e-5
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    out_proj_bias: bool | None = None  # None: use_bias; False on tp ranks (added after reduce)

    def __post_init__(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"Mamba-2: num_heads ({self.num_heads}) must be a multiple of "
                f"n_groups ({self.n_groups})"
            )

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        return self.intermediate_size + self.conv_dim + self.num_heads

    @classmethod
    def from_hf(cls, config) -> Mamba2Dims:
        """From a transformers `Mamba2Config` (or any object with its attribute names)."""
        return cls(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            n_groups=config.n_groups,
            state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size,
            use_conv_bias=config.use_conv_bias,
            use_bias=config.use_bias,
            norm_eps=config.layer_norm_epsilon,
            time_step_limit=tuple(config.time_step_limit),
        )

    def tp_local(self, tp: int) -> Mamba2Dims:
        """One tensor-parallel rank's sizes: heads and groups split, out_proj's bias left to the
        caller (a row-parallel layer adds it once, after the all-reduce)."""
        if tp == 1:
            return self
        if self.num_heads % tp or self.n_groups % tp:
            raise ValueError(
                f"Mamba-2 at tp={tp}: num_heads ({self.num_heads}) and n_groups "
                f"({self.n_groups}) must both be multiples of tp"
            )
        return replace(
            self, num_heads=self.num_heads // tp, n_groups=self.n_groups // tp, out_proj_bias=False
        )


@dataclass
class Mamba2State:
    """One layer's decoding / segment-boundary state."""

    conv: Tensor  # [b, conv_dim, K-1]: the last K-1 inputs of the conv
    ssm: Tensor  # [b, H, head_dim, N], fp32 (fp64 in fp64 models)


class GatedGroupRMSNorm(nn.Module):
    """HF's MambaRMSNormGated (norm_before_gate=False): RMSNorm of y * SiLU(z) per group."""

    def __init__(self, size: int, group_size: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: Tensor, gate: Tensor) -> Tensor:
        cdt = compute_dtype(y.dtype)
        h = y.to(cdt) * F.silu(gate.to(cdt))
        grouped = h.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.flatten(-2).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """Mamba-2 mixer with HF's parameter names and shapes (see the module docstring)."""

    def __init__(self, dims: Mamba2Dims, use_kernels: bool = True, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        d = self.dims = dims
        self.use_kernels = use_kernels
        self.in_proj = nn.Linear(d.hidden_size, d.in_proj_size, bias=d.use_bias, **f)
        self.conv1d = nn.Conv1d(
            d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim, bias=d.use_conv_bias, **f
        )  # no padding: causal_conv pads with the halo
        self.dt_bias = nn.Parameter(torch.empty(d.num_heads, **f))
        self.A_log = nn.Parameter(torch.empty(d.num_heads, **f))
        self.D = nn.Parameter(torch.empty(d.num_heads, **f))
        group = d.intermediate_size // d.n_groups
        self.norm = GatedGroupRMSNorm(d.intermediate_size, group, d.norm_eps, **f)
        out_bias = d.use_bias if d.out_proj_bias is None else d.out_proj_bias
        self.out_proj = nn.Linear(d.intermediate_size, d.hidden_size, bias=out_bias, **f)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self, generator: torch.Generator | None = None) -> None:
        """HF's A_log, D and dt_bias initialisation. Right for a full (tp=1) mixer only: a tp
        rank takes its slice of the full tensors (mamba2_tp.shard_mamba2)."""
        full = mamba2_ssm_init(self.dims.num_heads, generator)
        for name, value in full.items():
            getattr(self, name).copy_(value)

    # ---- the pieces (context parallel composes them around its collectives) ----

    def project(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[b, l, hidden] -> z [b, l, I], xBC [b, l, conv_dim] (before the conv), dt [b, l, H]."""
        d = self.dims
        return self.in_proj(hidden).split([d.intermediate_size, d.conv_dim, d.num_heads], -1)

    def conv(
        self, xBC: Tensor, halo: Tensor | None = None, reset_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """SiLU(causal conv) of xBC and the next halo [b, conv_dim, K-1]."""
        bias = self.conv1d.bias
        return causal_conv(xBC, self.conv1d.weight[:, 0], bias, halo, reset_mask, self.use_kernels)

    def ssm_inputs(self, xBC: Tensor, dt: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """x [b, l, H, P], the step dt [b, l, H] (compute dtype), A [H], B and C [b, l, G, N]."""
        d = self.dims
        gn = d.n_groups * d.state_size
        x, B, C = xBC.split([d.intermediate_size, gn, gn], dim=-1)
        cdt = compute_dtype(xBC.dtype)
        dt = F.softplus(dt.to(cdt) + self.dt_bias.to(cdt)).clamp(*d.time_step_limit)
        A = -torch.exp(self.A_log.to(cdt))
        unflat = (d.n_groups, d.state_size)
        x = x.unflatten(-1, (d.num_heads, d.head_dim))
        return x, dt, A, B.unflatten(-1, unflat), C.unflatten(-1, unflat)

    def scan(
        self,
        xBC: Tensor,
        dt: Tensor,
        reset_mask: Tensor | None = None,
        initial_state: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The SSD scan of the conv's output: y [b, l, H, P] (compute dtype), final SSM state."""
        x, dt, A, B, C = self.ssm_inputs(xBC, dt)
        return ssd_scan(
            x, dt, A, B, C, self.dims.chunk_size, D=self.D, initial_state=initial_state,
            reset_mask=reset_mask, use_kernels=self.use_kernels,
        )  # fmt: skip

    def gate_norm(self, y: Tensor, z: Tensor) -> Tensor:
        """norm(y * SiLU(z)) [b, l, I]: out_proj's input (a row-parallel layer's local part)."""
        return self.norm(y.flatten(-2), z)

    # ---- whole sequences ----

    def mix(
        self,
        hidden: Tensor,
        reset_mask: Tensor | None = None,
        state: Mamba2State | None = None,
    ) -> tuple[Tensor, Mamba2State]:
        """Everything before out_proj: ([b, l, I] in hidden's dtype, the state after the row)."""
        z, xBC, dt = self.project(hidden)
        halo = None if state is None else state.conv
        xBC, halo = self.conv(xBC, halo, reset_mask)
        ssm = None if state is None else state.ssm
        y, ssm = self.scan(xBC, dt, reset_mask, ssm)
        return self.gate_norm(y, z).to(hidden.dtype), Mamba2State(halo, ssm)

    def forward(
        self,
        hidden: Tensor,
        reset_mask: Tensor | None = None,
        state: Mamba2State | None = None,
        return_state: bool = False,
    ) -> Tensor | tuple[Tensor, Mamba2State]:
        """[b, l, hidden] -> [b, l, hidden]; `reset_mask` [b, l] marks document starts, `state`
        continues a previous segment (prefill after a prompt, a context-parallel rank)."""
        mixed, new_state = self.mix(hidden, reset_mask, state)
        out = self.out_proj(mixed)
        return (out, new_state) if return_state else out

    # ---- decoding: one token, constant memory ----

    def zero_state(self, batch: int, device=None, dtype: torch.dtype | None = None) -> Mamba2State:
        d = self.dims
        dtype = dtype or self.in_proj.weight.dtype
        conv = torch.zeros(batch, d.conv_dim, d.conv_kernel - 1, device=device, dtype=dtype)
        shape = (batch, d.num_heads, d.head_dim, d.state_size)
        return Mamba2State(conv, torch.zeros(shape, device=device, dtype=compute_dtype(dtype)))

    def step(self, hidden: Tensor, conv_state: Tensor, ssm_state: Tensor):
        """One token: hidden [b, hidden] -> (out [b, hidden], conv_state, ssm_state), the new
        states returned (the inputs are not modified). Equal to `forward` token by token."""
        d = self.dims
        z, xBC, dt = self.project(hidden)
        window = torch.cat((conv_state.to(xBC.dtype), xBC[:, :, None]), dim=2)  # [b, c, K]
        w = self.conv1d.weight[:, 0]
        conv = (window.to(w.dtype) * w).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        xBC_act = F.silu(conv).to(xBC.dtype)
        x, dt, A, B, C = self.ssm_inputs(xBC_act, dt)
        cdt = dt.dtype
        heads_per_group = d.num_heads // d.n_groups
        B = B.to(cdt).repeat_interleave(heads_per_group, dim=1)  # [b, H, N]
        C = C.to(cdt).repeat_interleave(heads_per_group, dim=1)
        x = x.to(cdt)
        decay = torch.exp(dt * A)[..., None, None]
        ssm = decay * ssm_state.to(cdt) + (dt[..., None] * x)[..., None] * B[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", ssm, C) + self.D.to(cdt)[:, None] * x
        out = self.out_proj(self.gate_norm(y, z).to(hidden.dtype))
        return out, window[:, :, 1:], ssm


def mamba2_ssm_init(
    num_heads: int,
    generator: torch.Generator | None = None,
    time_step_min: float = 1e-3,
    time_step_max: float = 0.1,
    time_step_floor: float = 1e-4,
) -> dict[str, Tensor]:
    """Full fp32 A_log, D and dt_bias as HF initialises them: A = 1..H, D = 1, dt log-uniform
    in [min, max] (floored) and dt_bias its inverse softplus."""
    a_log = torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32))
    u = torch.rand(num_heads, generator=generator)
    lo, hi = math.log(time_step_min), math.log(time_step_max)
    dt = torch.exp(u * (hi - lo) + lo).clamp(min=time_step_floor)
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) == dt
    return {"A_log": a_log, "D": torch.ones(num_heads), "dt_bias": dt_bias}
