"""`general.ignore_sanity_checks: false`: check after every step that the dp replicas hold the
same parameters (and the tied copies agree), as Nanotron's sanity checks do.

It costs two small all-reduces and a host sync per step, so it is off by default (Nanotron's
default too) and meant for debugging a layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SanityCheckError(RuntimeError):
    """Replicas that should be identical are not: a bug, not a user error."""


def check_dp_replicas(
    named: list[tuple[str, torch.Tensor]], dp_group, dp_size: int, step: int
) -> None:
    """Raise when a parameter differs between dp ranks (compared by an fp64 checksum)."""
    if dp_size == 1 or not named:
        return
    sums = torch.stack([p.detach().double().sum() for _, p in named])
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=dp_group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=dp_group)
    differ = torch.nonzero(high != low).flatten().tolist()
    if differ:
        names = ", ".join(named[i][0] for i in differ[:3])
        raise SanityCheckError(f"step {step}: dp replicas disagree on {names}")
