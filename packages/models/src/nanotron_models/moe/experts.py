"""The routed experts: SwiGLU MLPs stacked over this rank's local experts, run as one grouped
matmul over the tokens sorted by expert.

Weights (names fixed for checkpoints and the HF mapping): `gate_up_proj` [E_local, H, 2 I]
(gate then up along the last dim) and `down_proj` [E_local, I, H], so a row x of expert e
computes (silu(x @ G_e) * (x @ U_e)) @ D_e. The activation is a registry entry
(`EXPERT_ACTIVATIONS`): `relu2` (Nemotron-H's non-gated experts) holds `up_proj`
[E_local, H, I] instead and computes relu(x @ U_e)^2 @ D_e.

Kernels: `torch._grouped_mm` (offsets = running token counts, read on the device: no host
sync) where it runs; in torch 2.13 that is eager CPU in fp32, bf16 and fp16, and CUDA (a
CUTLASS kernel for bf16 on sm90+, torch's own per-group loop otherwise), when every row
stride is a multiple of 16 bytes (H and I multiples of 4 in fp32, 8 in bf16). Compiled code
needs bf16 (the op's meta function says so). Elsewhere a loop over the LOCAL experts (one
matmul each; it reads the counts on the host, a sync). Both compute the same products:
tests/models/test_moe.py compares them with a dense per-expert reference.

The weight gradients are computed in the backward's B under the zero-bubble split (autograd's
grouped-mm backward; no deferral): the schedule keeps them and accumulates them in W.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _swiglu(hidden: torch.Tensor) -> torch.Tensor:
    gate, up = hidden.chunk(2, dim=-1)
    return F.silu(gate) * up


def _relu2(hidden: torch.Tensor) -> torch.Tensor:
    return F.relu(hidden).square()


# activation -> (its first projection's name, that projection's width in units of I, the
# function): Qwen2-MoE / Mixtral's gated SiLU, Nemotron-H's relu2
EXPERT_ACTIVATIONS = {"swiglu": ("gate_up_proj", 2, _swiglu), "relu2": ("up_proj", 1, _relu2)}


def grouped_mm_runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands here (see the module docstring)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16,
                                                            torch.float16):  # fmt: skip
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    align = 16 // x.element_size()
    return all(w.shape[-1] % align == 0 and w.shape[-2] % align == 0 for w in weights)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` [N, K] grouped by expert (group g ends at offsets[g]) times w[g] [K, M]."""
    return torch._grouped_mm(x, w, offs=offsets)


def looped_matmul(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The same as `grouped_matmul`, one matmul per group (`sizes`: rows per group, on the host)."""
    parts = [rows @ w[g] for g, rows in enumerate(x.split(sizes))]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


class GroupedExperts(nn.Module):
    def __init__(
        self,
        num_local_experts: int,
        first_local_expert: int,
        hidden_size: int,
        intermediate_size: int,
        device=None,
        dtype=None,
        activation: str = "swiglu",
    ):
        super().__init__()
        self.num_local_experts, self.first_local_expert = num_local_experts, first_local_expert
        e, h, i = num_local_experts, hidden_size, intermediate_size
        self.first_name, width, self.activation = EXPERT_ACTIVATIONS[activation]
        first = nn.Parameter(torch.empty(e, h, width * i, device=device, dtype=dtype))
        self.register_parameter(self.first_name, first)
        self.down_proj = nn.Parameter(torch.empty(e, i, h, device=device, dtype=dtype))
        self.use_grouped_mm = True  # False: the loop (tests compare the two)

    @property
    def first_proj(self) -> nn.Parameter:
        """`gate_up_proj` or `up_proj`, by the activation."""
        return getattr(self, self.first_name)

    def forward(
        self,
        tokens: torch.Tensor,
        counts: torch.Tensor,
        gate_up: torch.Tensor | None = None,
        down: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [N, H] grouped by local expert, counts [E_local] rows each -> [N, H]. The
        weights (`gate_up`: the first projection) as this forward reads them (copy_to_tp under
        sequence parallel), default the parameters."""
        gate_up = self.first_proj if gate_up is None else gate_up
        down = self.down_proj if down is None else down
        if self.use_grouped_mm and grouped_mm_runs(tokens, gate_up, down):
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            hidden = grouped_matmul(tokens, gate_up, offsets)
            return grouped_matmul(self.activation(hidden).contiguous(), down, offsets)
        sizes = counts.tolist()  # the loop needs the group sizes on the host
        return looped_matmul(self.activation(looped_matmul(tokens, gate_up, sizes)), down, sizes)
