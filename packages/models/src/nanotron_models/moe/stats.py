"""Per-step MoE statistics on the device (no host sync), and the per-step hooks the trainer
calls: `begin_moe_step` (reset, and the aux loss's gradient scale) before the micro-batches,
`update_expert_biases` (the sigmoid_bias router's balancing) after the optimizer step.

`MoEStats` (read by the metrics): `load` [num_experts] float32, (token, slot) assignments to
each GLOBAL expert from this rank's tokens, summed over the step's micro-batches (not reduced
over dp / cp / tp-sequence-parallel ranks); `aux_loss` and `z_loss` [] the sums over
micro-batches of the unscaled values (already whole-micro-batch values); `micro_batches`.
The tensors exist from the first training forward on (None before).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.compile_boundary import eager_under_compile

from .router import update_expert_bias


class MoEStats:
    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.load: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.micro_batches = 0

    @eager_under_compile  # a host-side accumulation: no graph
    def add(self, counts: torch.Tensor, aux: torch.Tensor, z: torch.Tensor) -> None:
        if self.load is None:
            self.load = torch.zeros(self.num_experts, dtype=torch.float32, device=counts.device)
            self.aux_loss = torch.zeros((), dtype=torch.float32, device=counts.device)
            self.z_loss = torch.zeros((), dtype=torch.float32, device=counts.device)
        self.load.add_(counts)
        self.aux_loss.add_(aux)
        self.z_loss.add_(z)
        self.micro_batches += 1

    def reset(self) -> None:
        for t in (self.load, self.aux_loss, self.z_loss):
            if t is not None:
                t.zero_()
        self.micro_batches = 0


def _modules(model: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def moe_blocks(model: nn.Module | Iterable[nn.Module]) -> list[tuple[int, nn.Module]]:
    """(global layer index, MoEBlock) of a stage, or of a list of chunks, in layer order: the
    modules holding MoE statistics (block.py imports this module, not the other way)."""
    found = {
        m.layer: m
        for root in _modules(model)
        for m in root.modules()
        if isinstance(getattr(m, "stats", None), MoEStats)
    }
    return sorted(found.items())


def moe_state_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint must keep for an exact resume (by global name): each
    sigmoid_bias router's expert bias, state moved by the training loop, not by autograd."""
    return [(n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias")]


def reset_moe_stats(model) -> None:
    for _, block in moe_blocks(model):
        block.stats.reset()


def begin_moe_step(blocks: list[tuple[int, nn.Module]], num_micro_batches: int) -> None:
    """Before a step's micro-batches (`blocks`: `moe_blocks`' list, found once): statistics
    zeroed, and the balance losses' gradient scaled as the schedules scale each micro-batch's
    lm loss (1 / micro-batches)."""
    for _, block in blocks:
        block.stats.reset()
        block.aux_scale = 1.0 / num_micro_batches


@torch.no_grad()
def update_expert_biases(blocks: list[tuple[int, nn.Module]], groups: Iterable) -> None:
    """After the optimizer step: every sigmoid_bias router's bias moves against the step's
    load, summed over `groups` (the ranks that saw other tokens: dp x cp, and tp under
    sequence parallel) so every replica applies the same update. One all-reduce for all the
    layers of the stage. `blocks`: `moe_blocks`' list."""
    routers = [
        (b.router, b.stats.load)
        for _, b in blocks
        if b.router.kind == "sigmoid_bias" and b.stats.load is not None
    ]
    if not routers:
        return
    loads = torch.stack([load for _, load in routers])
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(loads, group=group)
    for (router, _), load in zip(routers, loads):
        update_expert_bias(router, load)
