"""ZeRO-1: optimizer state and fp32 masters sharded over the data-parallel ranks.

The flat gradient buffer of every bucket (see data_parallel.py) is padded to a multiple of dp
and cut into dp equal chunks; dp rank r owns chunk r of every bucket. It steps only the
parameter elements in its chunks (`owned_ranges`), then `all_gather_params` rebuilds every
full parameter from the owners. Elementwise optimizers (Adam) therefore give exactly the
results of zero_stage 0, while each rank keeps ~1/dp of the optimizer state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.data_parallel import DataParallelGrads


def owned_ranges(grads: DataParallelGrads, zero_stage: int) -> list[tuple[nn.Parameter, int, int]]:
    """(param, start, end) flat element ranges this rank steps; zero 0 owns every parameter."""
    out: list[tuple[nn.Parameter, int, int]] = []
    for bucket in grads.buckets:
        if zero_stage == 0:
            lo, hi = 0, bucket.grad.numel()
        else:
            lo, hi = bucket.chunk_range(grads.dp_rank, grads.dp_size)
        for p, off in zip(bucket.params, bucket.offsets):
            start, end = max(off, lo), min(off + p.numel(), hi)
            if start < end:
                out.append((p, start - off, end - off))
    return out


def grad_norm_ranges(
    grads: DataParallelGrads, zero_stage: int
) -> list[tuple[nn.Parameter, int, int]]:
    """Ranges whose gradients this rank counts in the global norm: each element exactly once
    over dp (zero 0: dp rank 0 counts everything; zero 1: each rank its own chunks)."""
    if zero_stage == 0 and grads.dp_rank != 0:
        return []
    return owned_ranges(grads, zero_stage)


@torch.no_grad()
def all_gather_params(grads: DataParallelGrads) -> None:
    """After each rank stepped its chunks, give every rank the full updated parameters."""
    if grads.dp_size == 1:
        return
    use_tensor_api = dist.get_backend(grads.dp_group) == "nccl"
    for bucket in grads.buckets:
        dtype = bucket.params[0].dtype
        flat = torch.zeros(bucket.grad.numel(), dtype=dtype, device=bucket.grad.device)
        for p, off in zip(bucket.params, bucket.offsets):
            flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
        lo, hi = bucket.chunk_range(grads.dp_rank, grads.dp_size)
        mine = flat[lo:hi].clone()
        if use_tensor_api:
            dist.all_gather_into_tensor(flat, mine, group=grads.dp_group)
        else:
            dist.all_gather(list(flat.chunk(grads.dp_size)), mine, group=grads.dp_group)
        for p, off in zip(bucket.params, bucket.offsets):
            p.detach().copy_(flat[off : off + p.numel()].view_as(p))
