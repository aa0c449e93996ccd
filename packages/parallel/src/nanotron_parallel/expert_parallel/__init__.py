"""Expert parallelism: token dispatchers for mixture-of-experts blocks.

`make_dispatcher(kind, num_experts, ep_group)` is the entry: `LocalDispatcher` when the ep
group is absent or of one rank, else the dispatcher named by `moe_config.token_dispatcher_type`
(`DISPATCHERS`). Every dispatcher follows `dispatch.Dispatcher`.
"""

import torch.distributed as dist

from nanotron_parallel.expert_parallel.allgather import AllGatherDispatcher
from nanotron_parallel.expert_parallel.alltoall import AllToAllDispatcher
from nanotron_parallel.expert_parallel.dispatch import (
    Dispatched,
    Dispatcher,
    LocalDispatcher,
    expert_counts,
    sort_by_expert,
    weighted_unsort,
)
from nanotron_parallel.grid import ParallelConfigError
from nanotron_parallel.sharding import (
    ExpertShard,
    expert_shard,
    is_expert_param,
    mark_expert_param,
)

DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def make_dispatcher(kind: str, num_experts: int, ep_group: dist.ProcessGroup | None) -> Dispatcher:
    """The dispatcher of `kind` over `ep_group` (one rank or none: every expert is local)."""
    if kind not in DISPATCHERS:
        raise ParallelConfigError(
            f"token_dispatcher_type={kind!r} is not one of {sorted(DISPATCHERS)}"
        )
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return LocalDispatcher(num_experts)
    ep = dist.get_world_size(ep_group)
    if num_experts % ep:
        raise ParallelConfigError(
            f"num_experts={num_experts} must be divisible by expert_parallel_size={ep}"
        )
    return DISPATCHERS[kind](num_experts, ep_group)


__all__ = [
    "DISPATCHERS",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "Dispatched",
    "Dispatcher",
    "ExpertShard",
    "LocalDispatcher",
    "expert_counts",
    "expert_shard",
    "is_expert_param",
    "make_dispatcher",
    "mark_expert_param",
    "sort_by_expert",
    "weighted_unsort",
]
