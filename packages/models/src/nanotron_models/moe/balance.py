"""The balance losses of a MoE layer and how their gradient reaches the router.

Per layer and micro-batch, over the micro-batch's T tokens of the whole sequences (every
layout computes the one-process value: where the tokens are split over tp ranks (sequence
parallel) or cp ranks, the sums below are all-reduced over those groups):

- aux loss (Switch Transformer / GShard, Hugging Face Qwen2-MoE's normalisation):
  ``num_experts * sum_e f_e * P_e`` with ``f_e`` = (token, slot) assignments to expert e / T
  (so sum_e f_e = top_k) and ``P_e`` = mean router probability of e over the tokens.
  Perfect balance gives top_k; one expert taking every token with certainty (top_k 1)
  gives num_experts.
- z-loss (ST-MoE): mean over tokens of logsumexp(router logits)^2.

Both enter the gradient as ``router_aux_loss_coef * aux + router_z_loss_coef * z`` per layer
through `scale_balance_grad`: the block's output is returned unchanged and, in the backward,
the loss term receives the gradient ``scale`` (the factor the trainer gives one micro-batch's
lm loss), so nothing in the loss, the pipeline engines, recompute or the B/W split changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron_parallel.tensor_parallel import reduce_from_tp


class _ScaleBalanceGrad(torch.autograd.Function):
    """Identity on `out`; the backward also gives `loss` the gradient `scale`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        loss_grad = torch.full((), ctx.scale, dtype=torch.float32, device=grad.device)
        return grad, loss_grad, None


def scale_balance_grad(out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    return _ScaleBalanceGrad.apply(out, loss, scale)


class _SumBothWays(torch.autograd.Function):
    """All-reduce (sum) forward and backward: for a sum over cp ranks whose every rank adds the
    same loss, each rank's share then gets the gradient of all the ranks' copies, which the
    dp x cp mean of the gradients divides back (as the lm loss: cp times a rank's share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_token_groups(x: torch.Tensor, sp_group, cp_group, differentiable: bool):
    """`x` summed over the groups that split the micro-batch's tokens (None: not split).
    Differentiably: over tp (sequence parallel) the backward is the identity, as each tp
    rank's gate gradient is summed over tp afterwards (copy_to_tp); over cp both ways."""
    if sp_group is not None:
        if differentiable:
            x = reduce_from_tp(x, sp_group)
        else:
            dist.all_reduce(x, group=sp_group)
    if cp_group is not None:
        if differentiable:
            x = _SumBothWays.apply(x, cp_group)
        else:
            dist.all_reduce(x, group=cp_group)
    return x


def balance_losses(logits, probs, counts, sp_group=None, cp_group=None):
    """(aux, z) of one layer and micro-batch (fp32 scalars, differentiable) from this rank's
    router `logits` and `probs` [T, E] and assignment `counts` [E] (int, this rank's)."""
    num_tokens = torch.full((1,), probs.shape[0], dtype=torch.float32, device=probs.device)
    # One message per group for the counts and the token count, one for the differentiable sums.
    plain = sum_over_token_groups(
        torch.cat((counts.float(), num_tokens)), sp_group, cp_group, differentiable=False
    )
    z_sum = torch.logsumexp(logits, dim=-1).square().sum().reshape(1)
    sums = sum_over_token_groups(
        torch.cat((probs.sum(dim=0), z_sum)), sp_group, cp_group, differentiable=True
    )
    total = plain[-1]
    f, p = plain[:-1] / total, sums[:-1] / total
    aux = probs.shape[1] * (f * p).sum()
    return aux, sums[-1] / total
