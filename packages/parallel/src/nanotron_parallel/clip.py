"""Gradient clipping by the global norm over tp, pp and dp, each gradient element counted once.

A parameter replicated over tp (no ParamMeta, or one without a shard dim) is counted on tp
rank 0 only; a tied parameter (ParamMeta.tied_key) only on the first pipeline stage holding it;
over dp, the caller gives the ranges this rank counts (see zero.grad_norm_ranges). The squares
are summed over the world group, so every rank gets the same norm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


def _meta(param: nn.Parameter):
    from nanotron_parallel.sharding import get_param_meta

    return get_param_meta(param)


def default_counts_in_norm(tp_rank: int, is_first_stage: bool) -> Callable[[nn.Parameter], bool]:
    """The rule above, for this rank's coordinates."""

    def counts(param: nn.Parameter) -> bool:
        meta = _meta(param)
        replicated = meta is None or meta.shard_dim is None
        if replicated and tp_rank != 0:
            return False
        tied = meta is not None and getattr(meta, "tied_key", None) is not None
        return not (tied and not is_first_stage)

    return counts


@torch.no_grad()
def global_grad_norm(
    ranges: Iterable[tuple[nn.Parameter, int, int]],
    group: dist.ProcessGroup | None,
    counts: Callable[[nn.Parameter], bool],
) -> float:
    """L2 norm of `param.main_grad` over the given flat ranges on every rank of `group`."""
    total = torch.zeros((), dtype=torch.float64)
    for p, start, end in ranges:
        if counts(p):
            g = p.main_grad.reshape(-1)[start:end].double()
            total += torch.dot(g, g).cpu()
    device = _collective_device(group)
    total = total.to(device)
    dist.all_reduce(total, group=group)
    return float(total.sqrt())


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def clip_grads(params: Iterable[nn.Parameter], total_norm: float, max_norm: float) -> float:
    """Scale every main_grad by min(1, max_norm / (norm + 1e-6)); return the factor used."""
    coef = max_norm / (total_norm + 1e-6)
    if coef >= 1.0:
        return 1.0
    for p in params:
        p.main_grad.mul_(coef)
    return coef
