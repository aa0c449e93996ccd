"""Context parallelism: each of the cp ranks holds a slice of every sequence.

Layout (load-balanced causal split). A sequence of length S is cut into 2*cp chunks of
C = S / (2*cp) tokens; cp rank r holds chunks r and 2*cp-1-r, in that order. Under a causal
mask early chunks attend to few keys and late ones to many, so pairing chunk r with its mirror
gives every rank the same attention work (2*cp+1 chunks of keys per rank).

Attention. A rank's queries need the keys and values of every earlier token, which other cp
ranks hold. `context_parallel_attention` all-gathers K and V over the cp group (as the Llama 3
paper does; grouped-query attention gathers only the kv heads), puts them back in sequence
order and runs the ordinary kernel twice: chunk r against keys [0, (r+1)C), chunk 2cp-1-r
against keys [0, (2cp-r)C), each with the bottom-right-aligned causal mask the kernel already
has for a KV cache, which is exactly causality by global position. The autograd function
saves only the local q, k, v: the backward gathers K and V again, recomputes the two kernel
calls, and reduce-scatters dK and dV back to their owners. Saved activations therefore scale
as 1/cp (the gathered K and V exist only inside the forward and inside the backward).

The loss. Each cp rank sees 1/cp of the labelled tokens of a micro-batch. Its loss is
``cp * (sum of its token losses) / (labelled tokens of the whole micro-batch)``, so the mean
over the cp group, which the dp x cp gradient reduction (and the logged-loss mean) already
takes, is the sequence's token-weighted mean loss: the same as one process.

The batch is sliced once, where the trainer prepares it (`split_batch`); nothing is sliced
per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from nanotron_parallel.grid import ParallelConfigError
from nanotron_parallel.tensor_parallel.functional import (
    _all_gather_tensor,
    _reduce_scatter_tensor,
    native_reduce_scatter,
)

Group = dist.ProcessGroup | None
# The kernel: causal attention of q [s_q, b, h, d] on k, v [s_k, b, kv, d] with query i at key
# index s_k - s_q + i (bottom-right aligned); returns [s_q, b, h, d].
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Batch keys that are [b, s] per-token tensors: sliced along the sequence.
SEQUENCE_KEYS = ("input_ids", "label_ids", "label_mask", "position_ids")
LABEL_COUNT_KEY = "label_count"  # labelled tokens of the whole micro-batch (the loss divisor)


def chunk_size(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp) != 0:
        raise ParallelConfigError(
            f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}: context parallel "
            "cuts every sequence into 2*cp equal chunks"
        )
    return seq_len // (2 * cp)


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) cp rank `cp_rank` holds, in its local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions [S / cp] of this rank's tokens (its two chunks, in order)."""
    c = chunk_size(seq_len, cp)
    first, second = chunk_ids(cp_rank, cp)
    return torch.cat(
        (
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        )
    )


def split_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (a contiguous copy)."""
    if cp == 1:
        return x
    c = chunk_size(x.shape[dim], cp)
    first, second = chunk_ids(cp_rank, cp)
    return torch.cat((x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)), dim=dim)


def split_batch(batch: dict[str, torch.Tensor], cp_rank: int, cp: int) -> dict[str, torch.Tensor]:
    """This cp rank's part of a micro-batch of [b, S] tensors: its two chunks of each
    sequence-long key, the global positions of its tokens (unless the data gave its own
    position_ids, which are sliced like the tokens), and `label_count`, the labelled tokens of
    the whole micro-batch, which the loss divides by. A micro-batch is returned as it is when
    cp = 1."""
    if cp == 1:
        return batch
    seq_len = batch["input_ids"].shape[1]
    out = {
        k: split_sequence(v, 1, cp_rank, cp) if k in SEQUENCE_KEYS else v for k, v in batch.items()
    }
    if "position_ids" not in batch:
        positions = local_positions(seq_len, cp_rank, cp, batch["input_ids"].device)
        out["position_ids"] = positions.expand(batch["input_ids"].shape[0], -1)
    if "label_mask" in batch:
        out[LABEL_COUNT_KEY] = batch["label_mask"].sum(dtype=torch.float32)
    return out


def _gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along dim 0 (rank order)."""
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_tensor(out, x, group=group)
    return out


def _reduce_scatter_seq(x: torch.Tensor, group: Group, native: bool | None) -> torch.Tensor:
    """Sum over the group, keep this rank's block of dim 0."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    if native_reduce_scatter(group, native):
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        _reduce_scatter_tensor(out, x, group=group)
        return out
    dist.all_reduce(x, group=group)  # gloo: all-reduce + slice is the faster way
    return x.chunk(world, dim=0)[dist.get_rank(group)].contiguous()


def _to_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """[cp * 2C, ...] in rank order (rank r: chunks r, 2cp-1-r) -> [2cp * C, ...] in order."""
    by_rank = gathered.view(cp, 2, gathered.shape[0] // (2 * cp), *gathered.shape[1:])
    # chunks 0..cp-1 are the first halves in rank order; cp..2cp-1 the second halves reversed
    return torch.cat((by_rank[:, 0], by_rank[:, 1].flip(0))).flatten(0, 1)


def _local_attention(
    q: torch.Tensor, kv_gathered: torch.Tensor, n_kv: int, cp_rank: int, cp: int, kernel: Kernel
) -> torch.Tensor:
    """Both local query chunks against the gathered keys and values up to their end."""
    k_all, v_all = _to_sequence_order(kv_gathered, cp).split([n_kv, n_kv], dim=2)
    c = q.shape[0] // 2
    outs = []
    for half, chunk in enumerate(chunk_ids(cp_rank, cp)):
        end = (chunk + 1) * c
        outs.append(kernel(q[half * c : (half + 1) * c], k_all[:end], v_all[:end]))
    return torch.cat(outs)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, kernel, native):
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.save_for_backward(q, k, v)  # local only: the gathered K/V are not kept
        ctx.group, ctx.kernel, ctx.native, ctx.cp, ctx.cp_rank = group, kernel, native, cp, cp_rank
        kv = _gather_seq(torch.cat((k, v), dim=2), group)  # one collective for K and V
        return _local_attention(q, kv, k.shape[2], cp_rank, cp, kernel)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        n_kv = k.shape[2]
        kv = _gather_seq(torch.cat((k, v), dim=2), ctx.group).requires_grad_()
        q = q.detach().requires_grad_()
        with torch.enable_grad():
            out = _local_attention(q, kv, n_kv, ctx.cp_rank, ctx.cp, ctx.kernel)
        grad_q, grad_kv = torch.autograd.grad(out, (q, kv), grad_out)
        # Every rank's queries read every owner's keys: sum their gradients at the owner.
        grad_k, grad_v = _reduce_scatter_seq(grad_kv, ctx.group, ctx.native).split(
            [n_kv, n_kv], dim=2
        )
        return grad_q, grad_k, grad_v, None, None, None


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    kernel: Kernel,
    native_reduce_scatter: bool | None = None,
) -> torch.Tensor:
    """Causal attention of this cp rank's queries q [2C, b, h, d] over the whole sequence,
    whose keys and values k, v [2C, b, kv, d] are spread over `group` in the layout above.
    Returns [2C, b, h, d]. `kernel` is the single-device attention (bottom-right causal).
    `native_reduce_scatter`: see tensor_parallel.functional.native_reduce_scatter."""
    if dist.get_world_size(group) == 1:
        return kernel(q, k, v)
    return _ContextParallelAttention.apply(q, k, v, group, kernel, native_reduce_scatter)
