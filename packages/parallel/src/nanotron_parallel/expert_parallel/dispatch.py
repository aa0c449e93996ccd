"""Token dispatch for mixture-of-experts blocks: the protocol every dispatcher follows.

A dispatcher moves each (token, slot) assignment of a router's top-k choice to the rank that
owns the chosen expert, grouped by local expert so the experts run as one grouped matmul, and
brings the outputs home again. Routing weights never travel: ``combine`` weights the outputs on
the source rank, so the weights' gradients stay local too.

``LocalDispatcher`` is the single-rank case (expert parallel size 1): all experts are local and
dispatching is a stable sort by expert id. The expert-parallel dispatchers (all-to-all,
all-gather) live beside it and follow the same protocol.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor


class Dispatched(NamedTuple):
    """Rows for the local experts: ``tokens`` [N, H] grouped by local expert (experts in order),
    ``counts`` [num_local_experts] int64 on the device (rows per local expert), ``state`` what
    ``combine`` needs to bring the outputs back."""

    tokens: Tensor
    counts: Tensor
    state: Any


class Dispatcher(Protocol):
    num_experts: int
    num_local_experts: int
    first_local_expert: int

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> Dispatched:
        """x [T, H]; topk_idx [T, k] global expert ids; topk_weight [T, k] (differentiable)."""
        ...

    def combine(self, y: Tensor, state: Any) -> Tensor:
        """y [N, H] expert outputs in dispatched order -> [T, H] = sum over k of weight * output."""
        ...


def expert_counts(flat_idx: Tensor, num_experts: int) -> Tensor:
    """Rows per expert as int64 on the device. A scatter-add, not ``torch.bincount``: bincount
    reads the largest id back to the host on CUDA (a sync in the training step)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_idx.device)
    return counts.scatter_add_(0, flat_idx, torch.ones_like(flat_idx))


def sort_by_expert(topk_idx: Tensor) -> tuple[Tensor, Tensor]:
    """(order, token_of_row): the stable permutation of the flattened [T*k] assignments that
    groups them by expert (ties keep token order, so the layout is deterministic) and the
    source token of each sorted row."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.div(order, topk_idx.shape[1], rounding_mode="floor")


def weighted_unsort(y: Tensor, order: Tensor, weight: Tensor) -> Tensor:
    """[T, H] = sum over slots of weight[t, s] * y[row of (t, s)]. The rows are put back in
    (token, slot) order and summed over the slot dimension, not scattered with ``index_add``:
    the sum order is then fixed (CUDA's index_add uses atomics, whose order varies)."""
    num_tokens, top_k = weight.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    rows = y.index_select(0, inverse).view(num_tokens, top_k, y.shape[-1])
    return (rows * weight.to(y.dtype).unsqueeze(-1)).sum(dim=1)


class LocalDispatcher:
    """Every expert on this rank: sort the assignments by expert, gather, count."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.first_local_expert = 0

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> Dispatched:
        order, token_of_row = sort_by_expert(topk_idx)
        counts = expert_counts(topk_idx.reshape(-1), self.num_experts)
        return Dispatched(x.index_select(0, token_of_row), counts, (order, topk_weight))

    def combine(self, y: Tensor, state: Any) -> Tensor:
        order, topk_weight = state
        return weighted_unsort(y, order, topk_weight)


class GroupExperts:
    """The experts a rank of an expert-parallel group owns: rank r of the ep ranks holds the
    contiguous experts [r * E / ep, (r + 1) * E / ep) (checkpoints store them by global index)."""

    def __init__(self, num_experts: int, group: torch.distributed.ProcessGroup):
        self.group, self.ep_size = group, torch.distributed.get_world_size(group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.first_local_expert = torch.distributed.get_rank(group) * self.num_local_experts
