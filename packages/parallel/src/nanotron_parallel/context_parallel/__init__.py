"""Context parallelism: each of the cp ranks holds a slice of every sequence.

The layout (layout.py): a sequence is cut into 2*cp chunks and cp rank r holds chunks r and
2cp-1-r (causal load balance); the trainer slices each micro-batch once (`split_batch`) and
the loss divides by the whole micro-batch's label count.

Attention needs every earlier token's keys and values, which other cp ranks hold. Three ways,
one of them chosen per run (`CP_ATTENTIONS`, config `parallelism.cp_attention`):
- ``allgather`` (allgather.py): all-gather K/V, attend, reduce-scatter dK/dV. Simple; every
  rank holds the whole sequence's K/V during attention; the gather is not overlapped.
- ``ring`` (ring.py): K/V blocks passed around the cp ring by p2p, overlapped with the
  attention of the block in hand, merged by log-sum-exp; K/V held per rank: 2/cp.
- ``ulysses`` (ulysses.py): all-to-all from a sequence split to a head split and back;
  heads must divide by cp x tp.
All three attend by global positions through the kernel contract of kernels.py, so a model
mask (documents, sliding windows) given as `mask_fn` applies across the cp split.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron_parallel.compile_boundary import eager_under_compile

from .allgather import allgather_attention
from .kernels import (
    Kernel,
    MaskFn,
    Observer,
    causal_kernel,
    observed_kernel,
    reference_attention,
    reference_kernel,
)
from .layout import (
    LABEL_COUNT_KEY,
    SEQUENCE_KEYS,
    chunk_ids,
    chunk_size,
    local_positions,
    split_batch,
    split_sequence,
)
from .ring import ring_attention
from .ulysses import ulysses_attention

CP_ATTENTIONS = ("allgather", "ring", "ulysses")

__all__ = [
    "CP_ATTENTIONS",
    "LABEL_COUNT_KEY",
    "SEQUENCE_KEYS",
    "Kernel",
    "MaskFn",
    "Observer",
    "causal_kernel",
    "chunk_ids",
    "chunk_size",
    "context_parallel_attention",
    "local_positions",
    "reference_attention",
    "reference_kernel",
    "split_batch",
    "split_sequence",
]


@eager_under_compile  # collectives and p2p in autograd functions: run eagerly when compiled
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    kernel: Kernel,
    native_reduce_scatter: bool | None = None,
    *,
    method: str = "allgather",
    mask_fn: MaskFn | None = None,
    observe: Observer | None = None,
) -> torch.Tensor:
    """Causal attention of this cp rank's queries q [2C, b, h, d] over the whole sequence,
    whose keys and values k, v [2C, b, kv, d] are spread over `group` in the layout above.
    Returns [2C, b, h, d]. `kernel(q, k, v, q_index, k_index)`: the single-device attention
    by global positions (kernels.py), applying the model's mask; `mask_fn`: that mask, for
    the ring's own block kernels. `native_reduce_scatter`: the all-gather's dK/dV reduction
    (tensor_parallel.functional.native_reduce_scatter). `observe` (kernels.Observer): shown
    the queries and keys of every block of scores the forward computes, with their global
    positions (the ring's blocks; the all-gather's and Ulysses' kernel calls)."""
    single = dist.get_world_size(group) == 1
    if observe is not None and (method != "ring" or single):  # the ring observes its blocks
        kernel = observed_kernel(kernel, observe)
    if single:
        index = torch.arange(q.shape[0], device=q.device)
        return kernel(q, k, v, index, index)
    if method == "allgather":
        return allgather_attention(q, k, v, group, kernel, native_reduce_scatter)
    if method == "ring":
        return ring_attention(q, k, v, group, mask_fn, observe)
    if method == "ulysses":
        return ulysses_attention(q, k, v, group, kernel)
    raise ValueError(f"unknown context-parallel attention {method!r}: one of {CP_ATTENTIONS}")
