"""The Gated DeltaNet mixer: Hugging Face `Qwen3NextGatedDeltaNet`'s parameters and values.

    in_proj_qkvz: hidden -> per key head [q | k | v | z]  (d_k, d_k, r*d_v, r*d_v; r = H_v/H_k)
    in_proj_ba:   hidden -> per key head [b | a]          (r, r)
    conv1d:       depthwise causal conv (kernel K, no bias) + SiLU over [q | k | v] (all heads
                  of q, then of k, then of v)
    q, k:         L2-normalised per head (q also scaled by d_k^-0.5)
    beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)   (log decay per value head)
    the gated delta rule (gdn_scan.py), then per value head RMSNorm(o) * SiLU(z) (norm before
    the gate, weight [d_v] shared by the heads), out_proj: H_v*d_v -> hidden

Tensors are batch-first ([b, l, hidden]). The mixer is built from *local* sizes
(`GatedDeltaNetDims.tp_local`): under tensor parallel a rank holds H_k/tp key heads and their
H_v/tp value heads — a contiguous block of in_proj_qkvz's and in_proj_ba's rows (both are laid
out per key head) and its slice of each of the conv's [q | k | v] sections (gated_deltanet_tp.py)
— and out_proj is row-parallel. Nothing in the mixer has a bias.

Kernels (which runs where): the conv runs causal_conv1d's kernel on CUDA when installed and
the delta rule flash-linear-attention's when installed (see gdn_scan.py), PyTorch otherwise
and always on the CPU; `step` (decoding) is always PyTorch.

Decoding state per layer (`GatedDeltaNetState`): the conv's last K-1 inputs [b, conv_dim, K-1]
and the delta rule's state [b, H_v, d_k, d_v] (fp32), constant in the sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .gdn_scan import gated_delta_rule, l2_normalize, recurrent_step
from .ssd_scan import Tensor, causal_conv, compute_dtype


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """A mixer's sizes (full, or one tp rank's from `tp_local`), Qwen3-Next's meanings."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk_size: int = 64
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"Gated DeltaNet: linear_num_value_heads ({self.num_value_heads}) must be a "
                f"multiple of linear_num_key_heads ({self.num_key_heads})"
            )

    @property
    def heads_per_key(self) -> int:
        return self.num_value_heads // self.num_key_heads

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def qkvz_size(self) -> int:
        return 2 * self.key_dim + 2 * self.value_dim

    @classmethod
    def from_hf(cls, config) -> GatedDeltaNetDims:
        """From a transformers `Qwen3NextConfig` (or any object with its attribute names)."""
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet: hidden_act '{act}' (the conv's) must be silu")
        return cls(
            hidden_size=config.hidden_size,
            num_key_heads=config.linear_num_key_heads,
            num_value_heads=config.linear_num_value_heads,
            key_head_dim=config.linear_key_head_dim,
            value_head_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            norm_eps=config.rms_norm_eps,
        )

    def tp_local(self, tp: int) -> GatedDeltaNetDims:
        """One tensor-parallel rank's sizes: key heads and value heads split."""
        if tp == 1:
            return self
        if self.num_key_heads % tp or self.num_value_heads % tp:
            raise ValueError(
                f"Gated DeltaNet at tp={tp}: linear_num_key_heads ({self.num_key_heads}) and "
                f"linear_num_value_heads ({self.num_value_heads}) must both be multiples of tp"
            )
        return replace(
            self, num_key_heads=self.num_key_heads // tp,
            num_value_heads=self.num_value_heads // tp,
        )  # fmt: skip


@dataclass
class GatedDeltaNetState:
    """One layer's decoding / segment-boundary state."""

    conv: Tensor  # [b, conv_dim, K-1]: the last K-1 inputs of the conv
    recurrent: Tensor  # [b, H_v, d_k, d_v], fp32 (fp64 in fp64 models)


class GatedRMSNorm(nn.Module):
    """HF's Qwen3NextRMSNormGated: weight * RMSNorm(y) * SiLU(z) over the last dim (d_v)."""

    def __init__(self, size: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, y: Tensor, gate: Tensor) -> Tensor:
        dtype, cdt = gate.dtype, compute_dtype(gate.dtype)
        h = y.to(dtype).to(cdt)  # HF's scan hands back the model's dtype; the norm runs in fp32
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(dtype) * F.silu(gate.to(cdt))).to(dtype)


class GatedDeltaNetMixer(nn.Module):
    """Gated DeltaNet with HF's parameter names and shapes (see the module docstring)."""

    def __init__(self, dims: GatedDeltaNetDims, use_kernels: bool = True, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        d = self.dims = dims
        self.use_kernels = use_kernels
        self.in_proj_qkvz = nn.Linear(d.hidden_size, d.qkvz_size, bias=False, **f)
        self.in_proj_ba = nn.Linear(d.hidden_size, 2 * d.num_value_heads, bias=False, **f)
        self.conv1d = nn.Conv1d(
            d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim, bias=False, **f
        )  # no padding: causal_conv pads with the halo
        self.dt_bias = nn.Parameter(torch.empty(d.num_value_heads, **f))
        self.A_log = nn.Parameter(torch.empty(d.num_value_heads, **f))
        self.norm = GatedRMSNorm(d.value_head_dim, d.norm_eps, **f)
        self.out_proj = nn.Linear(d.value_dim, d.hidden_size, bias=False, **f)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, generator: torch.Generator | None = None) -> None:
        """HF's A_log and dt_bias initialisation. Right for a full (tp=1) mixer only: a tp
        rank takes its slice of the full tensors (gated_deltanet_tp.shard_gated_deltanet)."""
        for name, value in gated_deltanet_init(self.dims.num_value_heads, generator).items():
            getattr(self, name).copy_(value)

    # ---- the pieces (context parallel composes them around its collectives) ----

    def project(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """[b, l, hidden] -> qkv [b, l, conv_dim] (before the conv, [q | k | v]), z [b, l, H_v,
        d_v], b and a [b, l, H_v]: HF's per-key-head layout regrouped by kind."""
        d = self.dims
        lead = hidden.shape[:-1]
        r = d.heads_per_key
        qkvz = self.in_proj_qkvz(hidden).unflatten(-1, (d.num_key_heads, -1))
        q, k, v, z = qkvz.split([d.key_head_dim, d.key_head_dim, r * d.value_head_dim,
                                 r * d.value_head_dim], dim=-1)  # fmt: skip
        b, a = self.in_proj_ba(hidden).unflatten(-1, (d.num_key_heads, 2 * r)).split([r, r], -1)
        qkv = torch.cat((q.flatten(-2), k.flatten(-2), v.flatten(-2)), dim=-1)
        z = z.reshape(*lead, d.num_value_heads, d.value_head_dim)
        return qkv, z, b.flatten(-2), a.flatten(-2)

    def conv(
        self, qkv: Tensor, halo: Tensor | None = None, reset_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """SiLU(causal conv) of qkv and the next halo [b, conv_dim, K-1]."""
        return causal_conv(qkv, self.conv1d.weight[:, 0], None, halo, reset_mask, self.use_kernels)

    def delta_inputs(
        self, qkv: Tensor, b: Tensor, a: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """From the conv's output: q, k [.., H_k, d_k] (normalised, q scaled; compute dtype),
        v [.., H_v, d_v], the log decay g and the write strength beta [.., H_v]."""
        d = self.dims
        q, k, v = qkv.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        cdt = compute_dtype(qkv.dtype)
        q, k = (l2_normalize(t.unflatten(-1, (-1, d.key_head_dim)).to(cdt)) for t in (q, k))
        q = q * d.key_head_dim**-0.5
        g = -self.A_log.to(cdt).exp() * F.softplus(a.to(cdt) + self.dt_bias.to(cdt))
        return q, k, v.unflatten(-1, (-1, d.value_head_dim)), g, b.sigmoid()

    def scan(
        self,
        qkv: Tensor,
        b: Tensor,
        a: Tensor,
        reset_mask: Tensor | None = None,
        initial_state: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The delta rule over the conv's output: o [b, l, H_v, d_v] and the final state."""
        q, k, v, g, beta = self.delta_inputs(qkv, b, a)
        return gated_delta_rule(
            q, k, v, g, beta, self.dims.chunk_size, initial_state, reset_mask, self.use_kernels
        )

    def gate_norm(self, o: Tensor, z: Tensor) -> Tensor:
        """norm(o) * SiLU(z) per value head, flattened [b, l, H_v*d_v]: out_proj's input."""
        return self.norm(o, z).flatten(-2)

    # ---- whole sequences ----

    def mix(
        self,
        hidden: Tensor,
        reset_mask: Tensor | None = None,
        state: GatedDeltaNetState | None = None,
    ) -> tuple[Tensor, GatedDeltaNetState]:
        """Everything before out_proj: ([b, l, H_v*d_v] in hidden's dtype, the state after)."""
        qkv, z, b, a = self.project(hidden)
        qkv, halo = self.conv(qkv, None if state is None else state.conv, reset_mask)
        o, rec = self.scan(qkv, b, a, reset_mask, None if state is None else state.recurrent)
        return self.gate_norm(o, z).to(hidden.dtype), GatedDeltaNetState(halo, rec)

    def forward(
        self,
        hidden: Tensor,
        reset_mask: Tensor | None = None,
        state: GatedDeltaNetState | None = None,
        return_state: bool = False,
    ) -> Tensor | tuple[Tensor, GatedDeltaNetState]:
        """[b, l, hidden] -> [b, l, hidden]; `reset_mask` [b, l] marks document starts, `state`
        continues a previous segment (prefill after a prompt, a context-parallel rank)."""
        mixed, new_state = self.mix(hidden, reset_mask, state)
        out = self.out_proj(mixed)
        return (out, new_state) if return_state else out

    # ---- decoding: one token, constant memory ----

    def zero_state(
        self, batch: int, device=None, dtype: torch.dtype | None = None
    ) -> GatedDeltaNetState:
        d = self.dims
        dtype = dtype or self.in_proj_qkvz.weight.dtype
        conv = torch.zeros(batch, d.conv_dim, d.conv_kernel - 1, device=device, dtype=dtype)
        shape = (batch, d.num_value_heads, d.key_head_dim, d.value_head_dim)
        rec = torch.zeros(shape, device=device, dtype=compute_dtype(dtype))
        return GatedDeltaNetState(conv, rec)

    def step(self, hidden: Tensor, conv_state: Tensor, recurrent_state: Tensor):
        """One token: hidden [b, hidden] -> (out [b, hidden], conv_state, recurrent_state),
        the new states returned (the inputs are not modified). Equal to `forward` token by
        token."""
        qkv, z, b, a = self.project(hidden)
        window = torch.cat((conv_state.to(qkv.dtype), qkv[:, :, None]), dim=2)  # [b, c, K]
        w = self.conv1d.weight[:, 0]
        act = F.silu((window.to(w.dtype) * w).sum(-1)).to(qkv.dtype)
        q, k, v, g, beta = self.delta_inputs(act, b, a)
        o, rec = recurrent_step(q, k, v, g, beta, recurrent_state)
        out = self.out_proj(self.gate_norm(o, z).to(hidden.dtype))
        return out, window[:, :, 1:], rec


def gated_deltanet_init(
    num_value_heads: int, generator: torch.Generator | None = None
) -> dict[str, Tensor]:
    """Full fp32 A_log and dt_bias as HF initialises them: A ~ U(0.01, 16), dt_bias = 1."""
    a = torch.rand(num_value_heads, generator=generator) * (16 - 0.01) + 0.01
    return {"A_log": torch.log(a), "dt_bias": torch.ones(num_value_heads)}
