"""lm_head matmul + vocab-parallel cross-entropy in one pass over token chunks.

The unfused loss materialises the fp32 logits of every token over this rank's vocab shard
(``[tokens, V/tp]``), keeps their softmax for the backward, and builds a second tensor of that
size for the gradient. Here the tokens are taken ``chunk_rows`` at a time: for each chunk the
forward computes the logit shard, the loss (the same three reductions over tp as
``cross_entropy.py``: max, then target logit and sum of exponentials in one all-reduce), and,
when a gradient will be needed, the gradient of the logits turned at once into the
gradients of the hidden states and of the weight. Only those two (the size of the input and
of the weight) live until the backward, which scales them by the incoming gradient.

The result is a weighted sum ``sum_i w_i * (ce_i + z_i)`` with per-token weights ``w``
(e.g. ``label_mask / count`` for the masked mean); z-loss (``z_i = c * lse_i^2``) is optional
and its weighted sum comes back detached, for logging. Under ``torch.no_grad`` (evaluation)
no gradient is computed. The hidden states must already be what the column-parallel lm_head
multiplies (replicated over tp: the caller's ``copy_to_tp`` / ``all_gather_to_tp`` sums the
hidden-state gradient over tp in its backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import nanotron_parallel.tensor_parallel.cpu_gemm as cpu_gemm
from nanotron_parallel.grid import ParallelConfigError
from nanotron_parallel.tensor_parallel.functional import all_reduce_
from nanotron_parallel.tensor_parallel.weight_grad import defer, fuses_accumulation

# Logit elements per chunk (64 MiB in fp32): rows = this // (V/tp). Big enough that the chunk's
# matmuls run at full speed (on the CPU one chunk of 1024 x 4096 beat 4 chunks of 256 by 5%),
# small next to the full logits of a long batch over a large vocab.
CHUNK_LOGITS = 1 << 24


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, targets, token_weights, group, vocab_size, z_coef, rows, grad, fuse
    ):
        rank = dist.get_rank(group)
        shard = weight.shape[0]
        start = rank * shard
        padding = None
        if vocab_size < start + shard:  # padding columns take no part in the softmax
            padding = torch.arange(start, start + shard, device=hidden.device) >= vocab_size
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z_sum = torch.zeros_like(loss)
        grad_hidden = torch.empty_like(hidden) if grad else None
        grad_weight = None
        for r0 in range(0, hidden.shape[0], rows):
            h = hidden[r0 : r0 + rows]
            w = token_weights[r0 : r0 + rows]
            logits = cpu_gemm.linear(h, weight).float()  # fp32 weights: the matmul output itself
            if padding is not None:
                logits.masked_fill_(padding, float("-inf"))
            row_max = all_reduce_(logits.amax(dim=-1), group, dist.ReduceOp.MAX)
            logits.sub_(row_max.unsqueeze(-1))
            local = targets[r0 : r0 + rows] - start
            mine = (local >= 0) & (local < shard)
            local = local.masked_fill(~mine, 0).unsqueeze(-1)
            target_logit = logits.gather(-1, local).squeeze(-1).masked_fill_(~mine, 0.0)
            logits.exp_()
            sums = all_reduce_(torch.stack((target_logit, logits.sum(dim=-1))), group)
            log_sum = sums[1].log()
            per_token = log_sum - sums[0]
            scale = w / sums[1]  # d(w * ce)/d logit = w * softmax - w * onehot
            if z_coef:
                lse = log_sum + row_max
                z = z_coef * lse.square()
                per_token = per_token + z
                z_sum += (z * w).sum()
                scale = scale * (1.0 + 2.0 * z_coef * lse)  # + d(w * c lse^2)/d logit
            # A token with weight 0 (masked, or an ignore-index label) adds nothing, even if
            # its label is outside the vocab.
            loss += (torch.where(w != 0, per_token, 0.0) * w).sum()
            if not grad:
                continue
            logits.mul_(scale.unsqueeze(-1))
            logits.scatter_add_(-1, local, (-(w * mine)).unsqueeze(-1))
            g = logits.to(weight.dtype)
            cpu_gemm.input_grad(g, weight, out=grad_hidden[r0 : r0 + rows])
            if grad_weight is None:
                grad_weight = torch.mm(g.t(), h).float()
            elif weight.dtype == torch.float32:
                grad_weight.addmm_(g.t(), h)
            else:  # chunks summed in fp32, like one matmul's accumulator
                grad_weight += torch.mm(g.t(), h)
        ctx.mark_non_differentiable(z_sum)
        ctx.grads = (grad_hidden, grad_weight, weight.dtype) if grad else None
        ctx.weight = weight  # the parameter itself, for a deferred W (weight_grad.defer)
        ctx.fuse = fuse
        return loss, z_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_z=None):
        if ctx.grads is None:
            raise RuntimeError(
                "the fused linear cross-entropy computed its gradients in the forward and "
                "gives them once: call backward a single time, and not under torch.no_grad"
            )
        grad_hidden, grad_weight, dtype = ctx.grads
        ctx.grads = None  # free them now (the pipeline keeps the graph of other micro-batches)
        grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        none = (None,) * 9
        # The weight gradient was computed in the forward (the fusion's point): a deferred W
        # (weight_grad.py) only scales and accumulates it; with `fuse`, straight into the
        # data-parallel buffer (its autograd edge then gets no gradient).
        if ctx.fuse:
            weight = ctx.weight

            def into_buffer():
                weight.accumulate_grad_scaled(grad_weight, grad_loss)
                return ()

            if not defer((), into_buffer):
                into_buffer()
            return grad_hidden, *none
        if defer((ctx.weight,), lambda: (grad_weight.mul_(grad_loss).to(dtype),)):
            return grad_hidden, *none
        grad_weight = grad_weight.mul_(grad_loss).to(dtype)
        return grad_hidden, grad_weight, *none[1:]


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_weights: torch.Tensor,
    group: dist.ProcessGroup | None,
    vocab_size: int | None = None,
    z_coefficient: float = 0.0,
    chunk_rows: int | None = None,
    fuse_accumulation: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``sum_i w_i (ce_i + z_i)``, ``sum_i w_i z_i`` detached) without the full logits.

    ``hidden``: ``[tokens, h]`` (replicated over tp); ``weight``: this rank's lm_head rows
    ``[vocab_padded / tp, h]``; ``targets``: ``[tokens]`` global ids; ``token_weights``:
    ``[tokens]`` fp32 (0 = not in the loss). ``vocab_size``: columns at or past it are padding.
    ``chunk_rows``: tokens per chunk (default: ``CHUNK_LOGITS // (V/tp)``).
    ``fuse_accumulation``: the weight has no other use in the graph (not tied), so a
    data-parallel buffer behind it (``accumulate_grad_scaled``) takes its gradient directly.
    Gradients flow to ``hidden`` and ``weight`` only. Targets are not range-checked (a host
    sync): the data is checked where it is read.
    """
    world = dist.get_world_size(group)
    padded = weight.shape[0] * world
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ParallelConfigError(
            f"vocab_size={vocab_size} must be in [1, {padded}] (the padded vocab: "
            f"{weight.shape[0]} rows per rank x tp={world})"
        )
    tokens = hidden.shape[0]
    if hidden.dim() != 2 or targets.shape != (tokens,) or token_weights.shape != (tokens,):
        raise ParallelConfigError(
            f"hidden {tuple(hidden.shape)} must be [tokens, h] with targets and token_weights "
            f"[tokens], got {tuple(targets.shape)} and {tuple(token_weights.shape)}"
        )
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_LOGITS // weight.shape[0])
    if chunk_rows < 1:
        raise ParallelConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if z_coefficient < 0:
        raise ParallelConfigError(f"z_coefficient must be >= 0, got {z_coefficient}")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    fuse = grad and fuses_accumulation(weight, fuse_accumulation, "accumulate_grad_scaled")
    return _LinearCrossEntropy.apply(
        hidden,
        weight,
        targets.long(),
        token_weights.float(),
        group,
        vocab_size,
        float(z_coefficient),
        int(chunk_rows),
        grad,
        fuse,
    )
