"""The Mamba-1 mixer (S6): Hugging Face `MambaMixer`'s parameters and values, in plain PyTorch.

    in_proj:  hidden -> [x | z]                       (sizes I, I; I = expand * hidden)
    conv1d:   depthwise causal conv (kernel K) + SiLU over x
    x_proj:   I -> [dt_low | B | C]                   (sizes R = dt_rank, N, N)
    dt_proj:  R -> I, + bias, softplus                A = -exp(A_log)  [I, N];  skip D [I]
    scan:     selective_scan.py, y * SiLU(z)
    out_proj: I -> hidden

Tensors are batch-first ([b, l, hidden]). The mixer is built from *local* sizes
(`Mamba1Dims.tp_local`), Megatron's split of the inner channels: a tp rank holds I/tp channels,
its rows of each section of in_proj, of the conv, dt_proj, A_log and D, and its columns of
x_proj and of the row-parallel out_proj. x_proj contracts over all I channels, so its partial
products are summed over tp (`reduce_x_proj`, set by the family's tp layer: an all-reduce
forward and backward, since dt, B and C feed each rank's own channels): Nanotron's example
applies the row-sharded x_proj without that sum, which is wrong at tp > 1.
Kernels: the scan runs mamba_ssm's on CUDA when installed (selective_scan.py), the conv
causal_conv1d's (ssd_scan.causal_conv), PyTorch otherwise and always on the CPU; `step` is
always PyTorch.

Decoding state per layer (`Mamba1State`): the conv's last K-1 inputs [b, I, K-1] and the SSM
state [b, I, N] (fp32; fp64 in fp64 models), constant in the sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .selective_scan import selective_scan
from .ssd_scan import Tensor, causal_conv, compute_dtype


@dataclass(frozen=True)
class Mamba1Dims:
    """A mixer's sizes (full, or one tp rank's from `tp_local`) and options (HF's meanings)."""

    hidden_size: int
    intermediate_size: int
    state_size: int = 16
    conv_kernel: int = 4
    time_step_rank: int = 1
    use_conv_bias: bool = True
    use_bias: bool = False
    chunk_size: int = 64  # the scan's chunk (selective_scan.py): speed only, not the result
    out_proj_bias: bool | None = None  # None: use_bias; False on tp ranks (added after reduce)

    @classmethod
    def from_hf(cls, config) -> Mamba1Dims:
        """From a transformers `MambaConfig` (or any object with its attribute names)."""
        return cls(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            state_size=config.state_size, conv_kernel=config.conv_kernel,
            time_step_rank=int(config.time_step_rank), use_conv_bias=config.use_conv_bias,
            use_bias=config.use_bias,
        )  # fmt: skip

    def tp_local(self, tp: int) -> Mamba1Dims:
        """One tensor-parallel rank's sizes: I/tp inner channels."""
        if tp == 1:
            return self
        if self.intermediate_size % tp:
            raise ValueError(
                f"Mamba-1 at tp={tp}: the inner size expand * d_model ({self.intermediate_size}) "
                "must be a multiple of tp"
            )
        return replace(self, intermediate_size=self.intermediate_size // tp, out_proj_bias=False)


@dataclass
class Mamba1State:
    """One layer's decoding state."""

    conv: Tensor  # [b, I, K-1]: the last K-1 inputs of the conv
    ssm: Tensor  # [b, I, N], fp32 (fp64 in fp64 models)


class Mamba1Mixer(nn.Module):
    """Mamba-1 mixer with HF's parameter names and shapes (see the module docstring)."""

    def __init__(self, dims: Mamba1Dims, use_kernels: bool = True, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        d = self.dims = dims
        i, r, n = d.intermediate_size, d.time_step_rank, d.state_size
        self.use_kernels = use_kernels
        self.in_proj = nn.Linear(d.hidden_size, 2 * i, bias=d.use_bias, **f)
        self.conv1d = nn.Conv1d(i, i, d.conv_kernel, groups=i, bias=d.use_conv_bias, **f)
        self.x_proj = nn.Linear(i, r + 2 * n, bias=False, **f)
        self.dt_proj = nn.Linear(r, i, bias=True, **f)
        a = torch.arange(1, n + 1, dtype=torch.float32).expand(i, n)
        self.A_log = nn.Parameter(torch.log(a).to(**f))  # S4D-real: A = -(1..N) per channel
        self.D = nn.Parameter(torch.ones(i, **f))
        out_bias = d.use_bias if d.out_proj_bias is None else d.out_proj_bias
        self.out_proj = nn.Linear(i, d.hidden_size, bias=out_bias, **f)

    def reduce_x_proj(self, partial: Tensor) -> Tensor:
        """x_proj's partial products -> the full ones: the identity on one rank; a tp layer
        sums them over its group."""
        return partial

    # ---- the pieces ----

    def project(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """[b, l, hidden] -> x (before the conv), z: [b, l, I] each."""
        return self.in_proj(hidden).chunk(2, dim=-1)

    def conv(
        self, x: Tensor, halo: Tensor | None = None, reset_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """SiLU(causal conv) of x and the next halo [b, I, K-1]."""
        bias = self.conv1d.bias
        return causal_conv(x, self.conv1d.weight[:, 0], bias, halo, reset_mask, self.use_kernels)

    def ssm_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """From the conv's output: dt [b, l, I] (softplus(dt_proj(dt_low)), compute dtype),
        A [I, N], B and C [b, l, N]."""
        d = self.dims
        full = self.reduce_x_proj(self.x_proj(x))
        dt_low, B, C = full.split([d.time_step_rank, d.state_size, d.state_size], dim=-1)
        cdt = compute_dtype(x.dtype)
        dt = F.linear(dt_low, self.dt_proj.weight).to(cdt) + self.dt_proj.bias.to(cdt)
        return F.softplus(dt), -torch.exp(self.A_log.to(cdt)), B, C

    def scan(
        self,
        x: Tensor,
        z: Tensor,
        reset_mask: Tensor | None = None,
        initial_state: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """y * SiLU(z) [b, l, I] (compute dtype) of the conv's output x, and the final state."""
        dt, A, B, C = self.ssm_inputs(x)
        return selective_scan(
            x, dt, A, B, C, self.D, z, reset_mask, initial_state, self.dims.chunk_size,
            self.use_kernels,
        )  # fmt: skip

    # ---- whole sequences ----

    def mix(
        self, hidden: Tensor, reset_mask: Tensor | None = None, state: Mamba1State | None = None
    ) -> tuple[Tensor, Mamba1State]:
        """Everything before out_proj: ([b, l, I] in hidden's dtype, the state after the row)."""
        x, z = self.project(hidden)
        x, halo = self.conv(x, None if state is None else state.conv, reset_mask)
        y, ssm = self.scan(x, z, reset_mask, None if state is None else state.ssm)
        return y.to(hidden.dtype), Mamba1State(halo, ssm)

    def forward(
        self,
        hidden: Tensor,
        reset_mask: Tensor | None = None,
        state: Mamba1State | None = None,
        return_state: bool = False,
    ) -> Tensor | tuple[Tensor, Mamba1State]:
        """[b, l, hidden] -> [b, l, hidden]; `reset_mask` [b, l] marks document starts, `state`
        continues a previous segment (prefill after a prompt)."""
        mixed, new_state = self.mix(hidden, reset_mask, state)
        out = self.out_proj(mixed)
        return (out, new_state) if return_state else out

    # ---- decoding: one token, constant memory ----

    def zero_state(self, batch: int, device=None, dtype: torch.dtype | None = None) -> Mamba1State:
        d = self.dims
        dtype = dtype or self.in_proj.weight.dtype
        conv = torch.zeros(
            batch, d.intermediate_size, d.conv_kernel - 1, device=device, dtype=dtype
        )
        shape = (batch, d.intermediate_size, d.state_size)
        return Mamba1State(conv, torch.zeros(shape, device=device, dtype=compute_dtype(dtype)))

    def step(self, hidden: Tensor, conv_state: Tensor, ssm_state: Tensor):
        """One token: hidden [b, hidden] -> (out [b, hidden], conv_state, ssm_state), the new
        states returned (the inputs are not modified). Equal to `forward` token by token."""
        x, z = self.project(hidden)
        window = torch.cat((conv_state.to(x.dtype), x[:, :, None]), dim=2)  # [b, I, K]
        w = self.conv1d.weight[:, 0]
        conv = (window.to(w.dtype) * w).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        x = F.silu(conv).to(x.dtype)
        dt, A, B, C = self.ssm_inputs(x)
        cdt = dt.dtype
        xc = x.to(cdt)
        decay = torch.exp(dt[..., None] * A)  # [b, I, N]
        ssm = decay * ssm_state.to(cdt) + (dt * xc)[..., None] * B.to(cdt)[:, None, :]
        y = torch.einsum("bin,bn->bi", ssm, C.to(cdt)) + self.D.to(cdt) * xc
        y = y * F.silu(z.to(cdt))
        return self.out_proj(y.to(hidden.dtype)), window[:, :, 1:], ssm


def mamba1_dt_init(
    intermediate_size: int,
    time_step_rank: int,
    generator: torch.Generator | None = None,
    dt_min: float = 1e-3,
    dt_max: float = 0.1,
    dt_init: str = "random",
    dt_scale: float = 1.0,
    dt_init_floor: float = 1e-4,
) -> dict[str, Tensor]:
    """Full fp32 dt_proj weight and bias as mamba_ssm and HF initialise them: the weight
    uniform in +-dt_scale / sqrt(dt_rank) ("random") or that constant ("constant"); dt
    log-uniform in [dt_min, dt_max], floored, and the bias its inverse softplus."""
    std = time_step_rank**-0.5 * dt_scale
    weight = torch.empty(intermediate_size, time_step_rank)
    if dt_init == "constant":
        weight.fill_(std)
    else:
        weight.uniform_(-std, std, generator=generator)
    u = torch.rand(intermediate_size, generator=generator)
    lo, hi = math.log(dt_min), math.log(dt_max)
    dt = torch.exp(u * (hi - lo) + lo).clamp(min=dt_init_floor)
    return {"dt_proj.weight": weight, "dt_proj.bias": dt + torch.log(-torch.expm1(-dt))}
