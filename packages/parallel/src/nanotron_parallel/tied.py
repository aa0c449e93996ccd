"""Parameters tied across pipeline stages (the embedding and the lm_head of a tied Llama).

A tied parameter has one copy on the first stage and one on the last, each marked with the
same `ParamMeta.tied_key` (unless one rank holds both ends, as the first rank does under the
zbv engine's V layout: then it holds one shared copy and no group is needed). Both copies start equal (same seed) and get the same update only if
they see the same gradient, so before the optimizer step the gradients are summed over the
tied group: the ranks of the first and last stage with the same dp and tp coordinates (their
tp shards cover the same rows). Sums are computed by one all-reduce, whose result is bitwise
the same on every member, so the copies stay bitwise equal through training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.sharding import get_param_meta

if TYPE_CHECKING:
    from nanotron_parallel.context import ParallelContext

_CACHE_ATTR = "_nanotron_tied_parameters"


class TiedParameterError(ValueError):
    """The stages of a tied group disagree on which parameters are tied."""


@dataclass
class TiedParameterGroup:
    """One tied key on this rank: its local copies and the group holding the other copies."""

    key: str
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None  # None when every copy lives on this rank (pp = 1)
    ranks: list[int]


def find_tied_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """This rank's parameters with a tied_key, by key (sorted; shared objects counted once)."""
    found: dict[str, list[nn.Parameter]] = {}
    for param in model.parameters():  # parameters() already yields a shared object once
        meta = get_param_meta(param)
        if meta is not None and meta.tied_key:
            found.setdefault(meta.tied_key, []).append(param)
    return dict(sorted(found.items()))


def tied_rank_lists(pc: ParallelContext) -> list[list[int]]:
    """The tied groups of the layout: first and last stage ranks sharing dp, cp and tp coords."""
    return [
        [pc.rank_of(d, t, 0, c), pc.rank_of(d, t, pc.pp_size - 1, c)]
        for d in range(pc.dp_size)
        for c in range(pc.cp_size)
        for t in range(pc.tp_size)
    ]


@dataclass
class TiedParameters:
    """Every tied group of one model on this rank. Build once; sync every step."""

    groups: list[TiedParameterGroup]

    @staticmethod
    def build(model: nn.Module, pc: ParallelContext, ends_apart: bool = True) -> TiedParameters:
        """Collective over the world when pp > 1 and `ends_apart` (the first and the last
        stage on different ranks; every rank must call it alike)."""
        local = find_tied_parameters(model)
        group, ranks = None, [pc.rank]
        if pc.pp_size > 1 and ends_apart:
            rank_lists = tied_rank_lists(pc)
            group = pc.new_groups(rank_lists)  # None on the middle stages
            if group is not None:
                ranks = next(r for r in rank_lists if pc.rank in r)
                _check_same_keys(list(local), group, ranks)
            elif local:
                raise TiedParameterError(
                    f"pipeline stage {pc.pp_rank} of {pc.pp_size} holds tied parameters "
                    f"{list(local)}; only the first and last stage may"
                )
        return TiedParameters([TiedParameterGroup(k, ps, group, ranks) for k, ps in local.items()])

    def sync_gradients(self, grad_of: Callable[[nn.Parameter], torch.Tensor] | None = None) -> None:
        """Sum each tied parameter's gradient over its copies, in place, so every copy holds
        the sum. Reads `grad_of(param)` (the data-parallel object's `tied_grad`: under
        ZeRO-2/3 this rank's gradient chunk, the same elements on every copy), else
        `param.main_grad` when the parameter has one, else `param.grad`."""
        for tied in self.groups:
            grads = [grad_of(p) if grad_of else _grad_tensor(p) for p in tied.params]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(dim=0)
            if tied.group is not None:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=tied.group)
            for g in grads:
                if g is not total:
                    g.copy_(total)

    def copies_equal(self) -> bool:
        """True when every copy of every tied parameter is bitwise equal (for tests and
        checks; collective over the tied groups)."""
        ok = True
        for tied in self.groups:
            ref = tied.params[0].detach()
            ok &= all(torch.equal(ref, p.detach()) for p in tied.params[1:])
            if tied.group is not None:
                other = ref.clone()
                dist.broadcast(other, src=tied.ranks[0], group=tied.group)
                flag = torch.tensor([int(ok and torch.equal(ref, other))], device=ref.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=tied.group)
                ok = bool(flag.item())
        return ok


def _grad_tensor(param: nn.Parameter) -> torch.Tensor:
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:
        return main_grad
    if param.grad is None:  # a copy that saw no data this step still takes part in the sum
        param.grad = torch.zeros_like(param)
    return param.grad


def _check_same_keys(keys: list[str], group: dist.ProcessGroup, ranks: list[int]) -> None:
    gathered: list[list[str] | None] = [None] * len(ranks)
    dist.all_gather_object(gathered, keys, group=group)
    if any(g != keys for g in gathered):
        detail = ", ".join(f"rank {r}: {g}" for r, g in zip(ranks, gathered))
        raise TiedParameterError(f"tied parameters differ between pipeline stages ({detail})")


def tied_parameters(
    model: nn.Module, pc: ParallelContext, ends_apart: bool = True
) -> TiedParameters:
    """The model's TiedParameters, built on the first call (collective) and then reused."""
    cached = model.__dict__.get(_CACHE_ATTR)
    if cached is None:
        cached = TiedParameters.build(model, pc, ends_apart)
        model.__dict__[_CACHE_ATTR] = cached
    return cached


def sync_tied_gradients(model: nn.Module, pc: ParallelContext) -> None:
    """Sum tied gradients over the tied groups; call on every rank before the optimizer step."""
    tied_parameters(model, pc).sync_gradients()


def tied_copies_equal(model: nn.Module, pc: ParallelContext) -> bool:
    """Whether every tied parameter's copies are bitwise equal across stages."""
    return tied_parameters(model, pc).copies_equal()
