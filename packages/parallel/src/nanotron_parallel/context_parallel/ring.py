"""Ring attention: keys and values travel around the cp ring, one rank's block at a time.

At step i (i = 0 .. cp-1) cp rank r holds the keys and values of rank j = r - i (mod cp),
sends them on to rank r+1 and receives rank j-1's from rank r-1, the transfer overlapped with
the attention of the block in hand. The partial outputs merge with the online-softmax rule:
with each block's log-sum-exp l_i, lse = log(sum exp l_i) and out = sum exp(l_i - lse) out_i.

The load-balanced layout (layout.py: rank r holds chunks r and 2cp-1-r) makes every step the
same work, C x 2C, and needs no mask beyond causality on the diagonal:
- step 0, the rank's own block: causal over its 2C tokens (its two chunks are in order);
- j < r: chunk j precedes both query chunks, chunk 2cp-1-j follows both: all queries against
  the first half of the block, all visible;
- j > r: both of j's chunks follow chunk r and precede chunk 2cp-1-r: the second half of the
  queries against the whole block, all visible.
With a model mask (documents, windows) the same blocks run through the math kernel with the
global positions of their queries and keys.

Memory: a rank holds its own K/V, the block in hand and the one arriving: the K/V bytes per
rank during attention are 2/cp of the whole sequence's (all-gather: 1). The autograd function
saves the local q, k, v, the output and its log-sum-exp (1/cp).

Backward: the blocks come round again; each rank adds its block gradients to the dK/dV that
travel with the block (fp32 or wider) and passes them on, so after cp steps every block's
gradient, summed over all the ranks that read it, arrives back at its owner. The block
gradients use the final output and log-sum-exp (kernels.block_backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .kernels import MaskFn, Observer, block_backward, block_forward
from .layout import local_positions

_KV_TAG, _GRAD_TAG = 16, 18  # k and v: tags 16, 17; dk and dv: 18, 19


def _exchange(send: list[torch.Tensor], group, tag: int) -> tuple[list, list[torch.Tensor]]:
    """Send `send` to the next cp rank and receive the previous one's tensors of the same
    shapes (async): (works to wait for, the tensors being received)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    world = group if group is not None else dist.group.WORLD
    nxt, prev = (dist.get_global_rank(world, (rank + d) % cp) for d in (1, -1))
    recv = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag + i) for i, t in enumerate(send)]
    ops += [dist.P2POp(dist.irecv, t, prev, group, tag + i) for i, t in enumerate(recv)]
    return dist.batch_isend_irecv(ops), recv  # grouped: NCCL cannot deadlock on the pair


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _block(step: int, rank: int, cp: int, c: int) -> tuple[slice, slice, str]:
    """Rows of the local queries, rows of the block in hand, and the block's kind."""
    if step == 0:
        return slice(0, 2 * c), slice(0, 2 * c), "causal"
    if (rank - step) % cp < rank:
        return slice(0, 2 * c), slice(0, c), "full"
    return slice(c, 2 * c), slice(0, 2 * c), "full"


def _merge(out, lse, block_out, block_lse, rows: slice) -> None:
    """Fold a block's (out, lse) into the running ones for query rows `rows`, in place."""
    prev_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(prev_lse, block_lse)
    safe = torch.where(torch.isfinite(new_lse), new_lse, 0.0)  # rows seeing nothing yet
    out[:, :, rows].mul_((prev_lse - safe).exp_()[..., None])
    out[:, :, rows].add_(block_out.mul_((block_lse - safe).exp_()[..., None]))
    lse[:, :, rows] = new_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, mask_fn, observe):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c, seq = q.shape[0] // 2, q.shape[0] * cp
        q_pos = local_positions(seq, rank, cp, q.device)
        kv, out, lse = [k.contiguous(), v.contiguous()], None, None  # p2p sends whole buffers
        for step in range(cp):
            if step < cp - 1:  # the next block travels while this one is computed
                works, arriving = _exchange(kv, group, _KV_TAG)
            rows, cols, kind = _block(step, rank, cp, c)
            k_pos = local_positions(seq, (rank - step) % cp, cp, q.device)
            kb, vb = kv[0][cols], kv[1][cols]
            if observe is not None:  # the forward's blocks only: the backward's are the same
                observe(q[rows], kb, q_pos[rows], k_pos[cols])
            o, o_lse = block_forward(q[rows], kb, vb, q_pos[rows], k_pos[cols], kind, mask_fn)
            if out is None:
                out, lse = o, o_lse
            else:
                _merge(out, lse, o, o_lse, rows)
            if step < cp - 1:
                _wait(works)
                kv = arriving
        out = out.permute(2, 0, 1, 3).to(q.dtype).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.mask_fn = group, mask_fn
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, mask_fn = ctx.group, ctx.mask_fn
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c, seq = q.shape[0] // 2, q.shape[0] * cp
        q_pos = local_positions(seq, rank, cp, q.device)
        grad4, out4 = grad.permute(1, 2, 0, 3), out.permute(1, 2, 0, 3)
        wide = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        kv, grad_works, dkv = [k.contiguous(), v.contiguous()], [], []
        for step in range(cp):
            if step < cp - 1:
                kv_works, arriving = _exchange(kv, group, _KV_TAG)
            rows, cols, kind = _block(step, rank, cp, c)
            k_pos = local_positions(seq, (rank - step) % cp, cp, q.device)
            dq_b, dk_b, dv_b = block_backward(
                grad4[:, :, rows], q[rows], kv[0][cols], kv[1][cols], out4[:, :, rows],
                lse[:, :, rows], q_pos[rows], k_pos[cols], kind, mask_fn,
            )  # fmt: skip
            dq[rows] += dq_b
            if step == 0:
                dkv = [torch.zeros(k.shape, dtype=wide, device=q.device) for _ in range(2)]
            else:  # this block's gradients from the ranks it visited before, arrived
                _wait(grad_works)
            dkv[0][cols] += dk_b
            dkv[1][cols] += dv_b
            del dq_b, dk_b, dv_b
            grad_works, dkv = _exchange(dkv, group, _GRAD_TAG)
            if step < cp - 1:
                _wait(kv_works)
                kv = arriving
        _wait(grad_works)  # back at its owner: this rank's block, from every rank
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q, k, v, group, mask_fn: MaskFn | None = None, observe: Observer | None = None
) -> torch.Tensor:
    """Causal attention of this cp rank's q [2C, b, h, d] over the whole sequence, whose keys
    and values [2C, b, kv, d] are spread over `group` (layout.py), by a ring of p2p transfers.
    `observe` (kernels.Observer) is shown each block's queries and keys in the forward."""
    return _RingAttention.apply(q, k, v, group, mask_fn, observe)
