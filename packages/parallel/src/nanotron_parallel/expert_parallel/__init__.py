"""Expert parallelism: token dispatchers for mixture-of-experts blocks."""

from nanotron_parallel.expert_parallel.dispatch import (
    Dispatched,
    Dispatcher,
    LocalDispatcher,
    expert_counts,
    sort_by_expert,
    weighted_unsort,
)

__all__ = [
    "Dispatched",
    "Dispatcher",
    "LocalDispatcher",
    "expert_counts",
    "sort_by_expert",
    "weighted_unsort",
]
