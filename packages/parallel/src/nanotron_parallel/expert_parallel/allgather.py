"""`token_dispatcher_type: allgather`: every rank of the ep group gathers all the group's
tokens and routing, computes the rows of its own experts, and a reduce-scatter brings each
token's outputs home.

Dispatch: all-gather x [T, H] -> [ep * T, H] (backward: a reduce-scatter of its gradient) and
the top-k ids (no gradient); sort the group's [ep * T * k] assignments by local expert with
every other expert's last (stable), and keep the local ones. Their number is read on the host,
the one device-to-host read per MoE layer and micro-batch (the rows are cut to it, so no rank
computes rows it does not own). Combine: each local output is put at its (token, slot) place
of a zero [ep * T * k, H] buffer, a reduce-scatter over the group sums the ranks' buffers (each
place is filled by exactly one rank) and returns this rank's [T * k, H], weighted on the
source rank (routing weights never travel). It moves ep times the tokens of the all-to-all but
only with equal splits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from nanotron_parallel.compile_boundary import eager_under_compile
from nanotron_parallel.expert_parallel.dispatch import Dispatched, GroupExperts, expert_counts
from nanotron_parallel.expert_parallel.functional import (
    all_gather_rows,
    gather_ids,
    host_sizes,
    reduce_scatter_rows,
)


class _State(NamedTuple):
    rows: Tensor  # the group's (token, slot) index of each dispatched row
    weight: Tensor  # topk_weight [T, k] of this rank's tokens


class AllGatherDispatcher(GroupExperts):
    """Every rank sees the ep group's tokens and computes its own experts' rows."""

    @eager_under_compile  # uneven sizes and collectives: a graph break, not a recompile each
    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> Dispatched:
        top_k, local = topk_idx.shape[1], self.num_local_experts
        tokens = all_gather_rows(x, self.group)  # [ep * T, H]
        ids = gather_ids(topk_idx, self.group).reshape(-1) - self.first_local_expert
        ids = torch.where((ids >= 0) & (ids < local), ids, local)  # others: `local`
        counts = expert_counts(ids, local + 1)[:local]
        order = torch.argsort(ids, stable=True)
        rows = order[: host_sizes(counts.sum())]  # the number of local rows
        picked = tokens.index_select(0, torch.div(rows, top_k, rounding_mode="floor"))
        return Dispatched(picked, counts, _State(rows, topk_weight))

    @eager_under_compile
    def combine(self, y: Tensor, state: Any) -> Tensor:
        num_tokens, top_k = state.weight.shape
        placed = y.new_zeros(num_tokens * top_k * self.ep_size, y.shape[-1])
        placed = placed.index_copy(0, state.rows, y)
        mine = reduce_scatter_rows(placed, self.group).view(num_tokens, top_k, -1)
        return (mine * state.weight.to(y.dtype).unsqueeze(-1)).sum(dim=1)
