"""`token_dispatcher_type: alltoall`: each (token, slot) row travels to the rank owning its
expert by an all-to-all with uneven splits, and its output comes back the same way.

Experts are split over the ep group in contiguous blocks (rank r owns experts
[r * E_local, (r + 1) * E_local)), so rows sorted by global expert are already grouped by
destination rank. Dispatch:
1. sort the [T * k] assignments by expert (stable) and count rows per global expert;
2. exchange the counts (a small all-to-all): each rank learns how many rows every source sends
   to each of its local experts;
3. read the split sizes on the host, the one device-to-host read per MoE layer and
   micro-batch: `all_to_all_single` takes its splits as Python ints (the backward reuses
   them, recompute reads them again);
4. exchange the rows; they arrive source-major, so a stable sort by local expert groups them
   for the grouped matmul.
Combine undoes 4 (the inverse permutation, the all-to-all back) and weights the outputs on the
source rank (`weighted_unsort`), so routing weights never travel.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from nanotron_parallel.compile_boundary import eager_under_compile
from nanotron_parallel.expert_parallel.dispatch import (
    Dispatched,
    GroupExperts,
    expert_counts,
    sort_by_expert,
    weighted_unsort,
)
from nanotron_parallel.expert_parallel.functional import all_to_all, exchange_counts, host_sizes


class _State(NamedTuple):
    order: Tensor  # the sort of step 1 (by global expert)
    weight: Tensor  # topk_weight [T, k]
    regroup: Tensor  # received rows -> local-expert order (step 4)
    send: list[int]  # rows sent to each rank
    recv: list[int]  # rows received from each rank


def inverse_permutation(order: Tensor) -> Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class AllToAllDispatcher(GroupExperts):
    """Rows to their experts' ranks and back by uneven all-to-alls over `group`."""

    @eager_under_compile  # uneven sizes and collectives: a graph break, not a recompile each
    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> Dispatched:
        ep, local = self.ep_size, self.num_local_experts
        order, token_of_row = sort_by_expert(topk_idx)
        sent = expert_counts(topk_idx.reshape(-1), self.num_experts)  # [ep * local]
        received = exchange_counts(sent, self.group).view(ep, local)  # [source, local expert]
        splits = host_sizes(torch.cat((sent.view(ep, local).sum(1), received.sum(1))))
        send, recv = splits[:ep], splits[ep:]
        rows = all_to_all(x.index_select(0, token_of_row), recv, send, self.group)
        # Received source-major: group them by local expert (stable: source order kept).
        expert_of_row = torch.arange(local, device=x.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1), output_size=len(rows))
        regroup = torch.argsort(expert_of_row, stable=True)
        state = _State(order, topk_weight, regroup, send, recv)
        return Dispatched(rows.index_select(0, regroup), received.sum(0), state)

    @eager_under_compile
    def combine(self, y: Tensor, state: Any) -> Tensor:
        rows = y.index_select(0, inverse_permutation(state.regroup))
        back = all_to_all(rows, state.send, state.recv, self.group)
        return weighted_unsort(back, state.order, state.weight)
