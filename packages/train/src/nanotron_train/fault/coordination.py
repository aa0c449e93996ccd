"""The key-value store shared by every rank of this launch, for agreement outside collectives.

Collectives must run in the same order on every rank and block; some decisions (stop after
this step, a rank hung, a background save finished) are taken by one rank at a time of its
choosing. The default process group's store (torchrun's TCPStore, hosted by the launcher's
agent, or a HashStore for one process) carries them. torch keeps a fresh store per restart
attempt; the prefix adds the attempt and a per-trainer counter so that several trainers in one
process (tests) never read each other's keys.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

from nanotron_parallel.context import store_attempt

_trainers = itertools.count()  # same sequence on every rank: all ranks build the same trainers


def shared_store(purpose: str) -> dist.Store | None:
    """A store namespace for one trainer and purpose; None without a process group."""
    if not dist.is_initialized():
        return None
    try:
        base = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    attempt = store_attempt() or "0"
    return dist.PrefixStore(f"nanotron/{attempt}/{purpose}/", base)


def next_trainer_id() -> int:
    return next(_trainers)


def try_get(store: dist.Store, key: str) -> bytes | None:
    """The value, or None when the key is not set yet (never blocks on a missing key)."""
    if not store.check([key]):
        return None
    return store.get(key)
