"""The router: a linear gate [E, H] scoring every expert for each token, then the top-k choice.

`softmax` (Qwen2-MoE, Nanotron): probabilities = softmax(logits) in fp32; each token goes to
its k most probable experts, weighted by those probabilities (divided by their sum with
`norm_topk_prob`, Hugging Face's key; Nanotron and HF's default keep them as they are).

`sigmoid_bias` (DeepSeek-V3's auxiliary-loss-free balancing): scores = sigmoid(logits); the
choice takes the k largest scores + `expert_bias` (a per-expert buffer, not trained by
autograd: `update_expert_bias` nudges it after each step against the step's load), the
weights are the chosen scores themselves (divided by their sum with `norm_topk_prob`), so the
bias steers the choice without entering the output. DeepSeek-V3's and Nemotron-H's group
limit (`n_group` > 1): the experts form n_group groups, each scored by the sum of its two
best biased scores, and a token chooses among the experts of its `topk_group` best groups;
`routed_scaling_factor` multiplies the weights (after the division). Hugging Face's
`NemotronHTopkRouter` computes the same.

Routing runs in fp32 whatever the model dtype (as Nanotron and HF keep the router's logits):
bf16 scores tie often enough to change the choice.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Routing(NamedTuple):
    logits: torch.Tensor  # [T, E] fp32
    probs: torch.Tensor  # [T, E] fp32: what the balance loss averages (rows sum to 1)
    topk_idx: torch.Tensor  # [T, k] int64 global expert ids
    topk_weight: torch.Tensor  # [T, k] fp32, differentiable


class Router(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        kind: str = "softmax",
        norm_topk_prob: bool = False,
        bias_update_rate: float = 0.0,
        device=None,
        dtype=None,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__()
        self.num_experts, self.top_k, self.kind = num_experts, top_k, kind
        self.n_group, self.topk_group, self.scaling = n_group, topk_group, routed_scaling_factor
        self.norm_topk_prob, self.bias_update_rate = norm_topk_prob, bias_update_rate
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, device=device, dtype=dtype)
        )
        if kind == "sigmoid_bias":
            bias = torch.zeros(num_experts, device=device, dtype=torch.float32)
            self.register_buffer("expert_bias", bias)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> Routing:
        """x [T, H]; `weight`: the gate as this forward should read it (copy_to_tp under
        sequence parallel), default the parameter."""
        weight = self.weight if weight is None else weight
        logits = F.linear(x.float(), weight.float())
        if self.kind == "softmax":
            probs = torch.softmax(logits, dim=-1)
            top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            choice = scores.detach() + self.expert_bias
            if self.n_group > 1:
                choice = group_limited(choice, self.n_group, self.topk_group)
            top_i = torch.topk(choice, self.top_k, dim=-1).indices
            top_w = scores.gather(-1, top_i)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            top_w = top_w * self.scaling
        return Routing(logits, probs, top_i, top_w)


def group_limited(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """`choice` [T, E] with -inf outside each token's `topk_group` best groups of experts (a
    group's score: the sum of its two best choices, or its one when a group holds one)."""
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    best = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)  # [T, n_group]
    keep = torch.zeros_like(best, dtype=torch.bool)
    keep.scatter_(1, best.topk(topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)


@torch.no_grad()
def update_expert_bias(router: Router, load: torch.Tensor) -> None:
    """DeepSeek-V3's update: bias += rate * sign(mean load - load) per expert, from the step's
    token counts `load` [E] (the same on every rank that holds this router: reduce it over the
    ranks that split the tokens first). In place, on the device, no host read."""
    rate = router.bias_update_rate
    router.expert_bias.add_(torch.sign(load.mean() - load), alpha=rate)
