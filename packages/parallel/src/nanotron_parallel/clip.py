"""Gradient clipping by the global norm over tp, pp and dp, each gradient element counted once.

A parameter replicated over tp (no ParamMeta, or one without a shard dim) is counted on tp
rank 0 only; a tied parameter (ParamMeta.tied_key) only on the first pipeline stage holding it;
over dp, the data-parallel object gives the views this rank counts
(`DataParallelGrads.grad_norm_views`). The squares are summed over the world group, so every
rank gets the same norm.

Everything stays on the device: the norm is a 0-d tensor and clipping multiplies by
`min(1, max_norm / (norm + 1e-6))` computed there, so a step needs no host sync for either;
the trainer reads the norm on the host only on the steps it logs. The norm reads each
gradient once (one `_foreach_norm` over merged flat views, their squares summed in fp64; on the
CPU the views are 2-D, a norm per 16k-element row, see `DataParallelGrads.grad_norm_views`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.phase_timer import comm_span
from nanotron_parallel.sharding import get_param_meta


def default_counts_in_norm(tp_rank: int, is_first_stage: bool) -> Callable[[nn.Parameter], bool]:
    """The rule above, for this rank's coordinates."""

    def counts(param: nn.Parameter) -> bool:
        meta = get_param_meta(param)
        replicated = meta is None or meta.shard_dim is None
        if replicated and tp_rank != 0:
            return False
        tied = meta is not None and getattr(meta, "tied_key", None) is not None
        return not (tied and not is_first_stage)

    return counts


def _norms(views: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each 1-D view and of each row of each 2-D view, in order (fp32)."""
    if all(v.dim() == 1 for v in views):
        return torch.stack(torch._foreach_norm(views))
    return torch.cat([torch.linalg.vector_norm(v, dim=-1).reshape(-1) for v in views])


@torch.no_grad()
def global_grad_norm(
    views: list[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """L2 norm (0-d float64 tensor on `device`) of the gradient `views` of every rank of `group`
    (a 2-D view counts each of its rows)."""
    if views:
        squares = _norms(views).double().square().sum()
    else:
        squares = torch.zeros((), dtype=torch.float64, device=device)
    # telemetry: a rank that arrives first waits here for the slowest; that wait is not the
    # optimizer's work (booked to it, it would make the waiting ranks look like stragglers)
    if dist.get_world_size(group) > 1:  # one process: the sum is its own (no gloo call)
        with comm_span("optimizer_comm"):
            dist.all_reduce(squares, group=group)
    return squares.sqrt()


@torch.no_grad()
def clip_grads(
    grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float
) -> torch.Tensor:
    """Scale the gradient tensors by min(1, max_norm / (norm + 1e-6)) on the device; return the
    factor (a 0-d tensor)."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(torch.float32))  # fp32 opmath, as a Python scalar
    return coef
