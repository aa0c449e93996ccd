"""Head-parallel (DeepSpeed-Ulysses) attention: an all-to-all trades the sequence split for a
head split, attention runs on whole sequences, and a second all-to-all trades back.

Before: each cp rank holds its two chunks of the sequence for all h heads (h per tp rank).
After the all-to-all: rank j holds the whole sequence, in order, for heads
[j h/cp, (j+1) h/cp), so heads must divide by cp x tp (config check). The kernel then runs
once, over global positions 0..S-1 (for a mask-free model: the plain causal kernel), and the
output returns to the sequence split the same way. Grouped-query attention: kv heads are
split over cp the same way when they divide by cp; otherwise each kv head is first repeated
(the fewest times that make them divide) so that every rank receives the kv heads its query
heads read. Communication: 4 all-to-alls of the local activations per attention, independent
of cp in volume per rank; memory and saved activations stay 1/cp.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nanotron_parallel.conjugate import conjugate

from .kernels import Kernel
from .layout import to_rank_order, to_sequence_order


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block i of dim 0 goes to rank i; block i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # (empty_like of a permuted view would keep its strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[2C, b, n, d] (this rank's chunks, all heads) -> [S, b, n/cp, d] (in order, its heads)."""
    cp = dist.get_world_size(group)
    s, b, n, d = x.shape
    send = x.view(s, b, cp, n // cp, d).movedim(2, 0)  # [cp (head group), 2C, b, n/cp, d]
    got = _all_to_all(send, group)  # [cp (source rank), 2C, b, n/cp, d]
    return to_sequence_order(got.flatten(0, 1), cp)


def heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `seq_to_heads`."""
    cp = dist.get_world_size(group)
    s, b, m, d = y.shape
    send = to_rank_order(y, cp).view(cp, s // cp, b, m, d)  # block i: rank i's chunks
    got = _all_to_all(send, group)  # [cp (head group), 2C, b, n/cp, d]
    return got.movedim(0, 2).reshape(s // cp, b, cp * m, d)


_seq_to_heads = conjugate(seq_to_heads, heads_to_seq)
_heads_to_seq = conjugate(heads_to_seq, seq_to_heads)


def ulysses_attention(q, k, v, group, kernel: Kernel) -> torch.Tensor:
    """Causal attention of this cp rank's q [2C, b, h, d] over the whole sequence (keys and
    values [2C, b, kv, d] spread over `group`, layout.py) by two all-to-alls over heads."""
    cp = dist.get_world_size(group)
    n_kv = k.shape[2]
    repeat = cp // math.gcd(n_kv, cp)  # kv heads repeated until they split over cp
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    kv = torch.cat((k, v), dim=2)
    # One all-to-all for k and v: the k heads and v heads are each split over cp.
    kv = kv.view(*kv.shape[:2], 2, cp, -1, kv.shape[-1]).transpose(2, 3).flatten(2, 4)
    kv_h = _seq_to_heads(kv, group)  # [S, b, cp-th of (k, v) heads, d]
    k_h, v_h = kv_h.view(*kv_h.shape[:2], 2, -1, kv_h.shape[-1]).unbind(2)
    q_h = _seq_to_heads(q, group)
    index = torch.arange(q_h.shape[0], device=q.device)
    return _heads_to_seq(kernel(q_h, k_h, v_h, index, index), group)
