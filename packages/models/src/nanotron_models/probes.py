"""Detail probes: statistics a layer measures of its own forward, on the trainer's detail steps
only (per-layer statistics, nanotron_train/reporting/layer_stats.py).

A probed module (attention, a mixture of experts' block) names its statistic in `probe_stat`
and leaves `probe` None: then its forward does nothing more. For a detail step the trainer sets
`probe` to a float64 view of its packed statistics on the device and clears it after the
forward passes; the forward folds its value into the view in place (no host read):
- `attn_max_logit` (a 0-d view): the largest pre-softmax score q.k/sqrt(d) a query gives a key
  it may see (causal, the layer's window and documents), over heads, positions and micro-batches;
  `max_attention_logit` computes it a block of queries at a time, never holding more scores
  than q has elements.
- `router_entropy` (a [2] view): the sum over this rank's tokens of the routing distribution's
  entropy -sum_e p_e log p_e, and the token count, for a token-weighted mean.
The code outside the models package finds probed modules through `detail_probes` only.
"""

from __future__ import annotations

import torch
from torch import nn

ATTN_MAX_LOGIT = "attn_max_logit"
ROUTER_ENTROPY = "router_entropy"
PROBE_STATS = (ATTN_MAX_LOGIT, ROUTER_ENTROPY)


def detail_probes(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module name, module) of every probed module of `model`, in model order."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "probe_stat", None)]


@torch.no_grad()
def max_attention_logit(
    q: torch.Tensor,
    k: torch.Tensor,
    mask=None,
    q_index: torch.Tensor | None = None,
    k_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """max over heads and visible (query, key) pairs of q.k * d**-0.5, 0-d fp32 or wider.

    q [s_q, b, h, d], k [s_k, b, kv, d] (grouped-query: h a multiple of kv) at global
    positions q_index, k_index (default: queries at the end of the keys, bottom-right causal);
    `mask(q_index, k_index)` (masks.AttentionMask) adds windows and documents. Blocks of
    queries keep each block's scores within q's size."""
    s_q, b, h, d = q.shape
    s_k, kv = k.shape[0], k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    kg = k.detach().to(dtype).permute(1, 2, 3, 0)[:, :, None]  # [b, kv, 1, d, s_k]
    if k_index is None:
        k_index = torch.arange(s_k, device=q.device)
        q_index = k_index[s_k - s_q :]
    rows = max(1, s_q * d // s_k)  # scores of a block: rows * s_k * b * h <= q.numel()
    best = torch.full((), float("-inf"), dtype=dtype, device=q.device)
    for start in range(0, s_q, rows):
        qc = q[start : start + rows].detach().to(dtype)
        c = qc.shape[0]
        qg = qc.permute(1, 2, 0, 3).reshape(b, kv, h // kv, c, d)
        scores = (qg @ kg) * d**-0.5  # [b, kv, g, c, s_k]
        qi = q_index[start : start + c]
        allowed = k_index[None, :] <= qi[:, None]  # [c, s_k]
        if mask is not None:
            allowed = (allowed & mask(qi, k_index)).unsqueeze(2)  # [b, 1, 1, c, s_k]
        best = torch.maximum(best, scores.masked_fill(~allowed, float("-inf")).amax())
    return best


def max_logit_observer(probe: torch.Tensor, mask=None):
    """A context-parallel attention's observer (nanotron_parallel's `Observer`) that folds the
    max logit of each block of queries and keys it is shown into `probe`: the ring's blocks,
    the all-gather's and Ulysses' kernel calls (each rank its queries, or heads, against the
    keys they see). A backward that shows a block again leaves the maximum unchanged."""

    def observe(q, k, q_index, k_index) -> None:
        probe.copy_(torch.maximum(probe, max_attention_logit(q, k, mask, q_index, k_index)))

    return observe


@torch.no_grad()
def routing_entropy_sums(probs: torch.Tensor) -> torch.Tensor:
    """[entropy summed over the tokens, token count] of a routing distribution [T, E]."""
    p = probs.detach().double()
    entropy = -torch.special.xlogy(p, p).sum()
    return torch.stack([entropy, p.new_full((), p.shape[0])])
