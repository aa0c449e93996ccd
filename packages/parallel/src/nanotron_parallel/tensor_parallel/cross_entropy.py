"""Cross-entropy over vocab-sharded logits, in fp32, without ever gathering the full vocab.

Each rank holds columns ``[r * V/tp, (r + 1) * V/tp)`` of the (padded) vocab. Three small
all-reduces over tp give the global max, the target logit and the sum of exponentials:
``loss = log(sum_j exp(z_j - m)) - (z_target - m)``. The gradient is ``softmax - onehot``,
computed locally from the saved shard of the softmax.

z-loss (PaLM; Nanotron's `z_loss_enabled`): ``c * lse^2`` with ``lse = log(sum_j exp(z_j))``
(``m`` added back), added to each token's loss. It reuses the same reductions; its gradient
``2 c lse * softmax`` joins the cross-entropy's in the same backward pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron_parallel.grid import ParallelConfigError
from nanotron_parallel.tensor_parallel.functional import all_reduce_


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, targets, group, vocab_size, z_coefficient=0.0):
        rank = dist.get_rank(group)
        shard = logits_shard.shape[-1]
        start = rank * shard
        logits = logits_shard.float()
        if vocab_size < start + shard:
            # Padding columns take no part in the softmax.
            columns = torch.arange(start, start + shard, device=logits.device)
            logits = logits.masked_fill(columns >= vocab_size, float("-inf"))

        # A rank made only of padding has a local max of -inf; the global max is finite.
        logits_max = all_reduce_(logits.amax(dim=-1), group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        local_target = targets - start
        mine = (local_target >= 0) & (local_target < shard)
        safe_target = local_target.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
        target_logit = all_reduce_(target_logit.masked_fill(~mine, 0.0), group)

        exp = shifted.exp()
        sum_exp = all_reduce_(exp.sum(dim=-1), group)
        log_sum = torch.log(sum_exp)
        loss = log_sum - target_logit
        ctx.z_coefficient = z_coefficient
        z_loss = None
        if z_coefficient:
            lse = log_sum + logits_max
            z_loss = z_coefficient * lse.square()
            loss = loss + z_loss
            ctx.mark_non_differentiable(z_loss)
            ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), safe_target, mine, lse)
        else:
            ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), safe_target, mine)
        ctx.input_dtype = logits_shard.dtype
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, _grad_z_loss=None):
        softmax, safe_target, mine, *lse = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, safe_target.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        if lse:  # d(c * lse^2)/dz = 2 c lse * softmax
            grad.addcmul_(softmax, (2.0 * ctx.z_coefficient * lse[0]).unsqueeze(-1))
        grad.mul_(grad_loss.float().unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup | None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape of ``targets``) from this rank's vocab shard.

    ``logits_shard``: ``[..., vocab_padded / tp]``; ``targets``: ``[...]`` global token ids.
    ``vocab_size``: the real vocab; columns at or past it are padding and are excluded.
    Targets are not range-checked here (a host sync per call): the data is checked where it
    is read.
    """
    loss, _ = _checked_apply(logits_shard, targets, group, vocab_size, 0.0)
    return loss


def vocab_parallel_cross_entropy_with_z_loss(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup | None,
    vocab_size: int | None,
    z_coefficient: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (cross-entropy + z-loss, z-loss): the first is differentiated, the second is
    its z-loss part (detached, for logging). ``z_coefficient`` must be > 0."""
    if not z_coefficient > 0:
        raise ParallelConfigError(f"z_coefficient must be > 0, got {z_coefficient}")
    return _checked_apply(logits_shard, targets, group, vocab_size, float(z_coefficient))


def _checked_apply(logits_shard, targets, group, vocab_size, z_coefficient):
    world = dist.get_world_size(group)
    padded = logits_shard.shape[-1] * world
    if vocab_size is None:
        vocab_size = padded
    if not 0 < vocab_size <= padded:
        raise ParallelConfigError(
            f"vocab_size={vocab_size} must be in [1, {padded}] (the padded vocab: "
            f"{logits_shard.shape[-1]} columns per rank x tp={world})"
        )
    if targets.shape != logits_shard.shape[:-1]:
        raise ParallelConfigError(
            f"targets shape {tuple(targets.shape)} must equal the logits shape without its "
            f"vocab dim, {tuple(logits_shard.shape[:-1])}"
        )
    return _VocabParallelCrossEntropy.apply(
        logits_shard, targets.long(), group, vocab_size, z_coefficient
    )
