"""Full tensor <-> per-rank shard, so initialisation and checkpoints ignore the topology.

A fused tensor (e.g. QKV = [q; k; v] along dim 0) is described by ``sections``: the sizes of
its parts along the sharded dim. Each part is split separately, so rank r holds
``[q_r; k_r; v_r]`` and a column-parallel matmul gives it matching q, k and v heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanotron_parallel.grid import ParallelConfigError

_META_ATTR = "_nanotron_param_meta"


@dataclass(frozen=True)
class ParamMeta:
    """How a parameter relates to its full tensor (read by checkpoints and grad clipping).

    ``shard_dim=None`` means the parameter is replicated over tp; ``tied_key`` names a
    parameter shared with another block (e.g. embedding and lm_head), or is None.
    ``interleaved`` (Muon's logical matrices, not the sharding): per section (the whole dim
    when ``sections`` is None), ``(n, parts)``: its rows are n repeats of blocks of sizes
    ``parts`` (e.g. per head [query | gate]), and part j over the n repeats is one logical
    matrix; None: each section is one.
    """

    full_shape: tuple[int, ...]
    shard_dim: int | None
    sections: tuple[int, ...] | None = None
    tp_rank: int = 0
    tp_size: int = 1
    tied_key: str | None = None
    interleaved: tuple[tuple[int, tuple[int, ...]], ...] | None = None

    @property
    def is_sharded(self) -> bool:
        return self.shard_dim is not None and self.tp_size > 1


def set_param_meta(param: torch.Tensor, meta: ParamMeta) -> None:
    """Attach ``meta`` to the parameter object itself (survives module moves and renames)."""
    setattr(param, _META_ATTR, meta)


def get_param_meta(param: torch.Tensor) -> ParamMeta | None:
    """The parameter's metadata; None means replicated over tp and untied."""
    return getattr(param, _META_ATTR, None)


def _check_sections(size: int, world: int, sections: Sequence[int] | None, what: str) -> list[int]:
    """Validated section sizes along the sharded dim (one section = the whole dim)."""
    parts = [size] if sections is None else [int(s) for s in sections]
    if sum(parts) != size or any(p < 0 for p in parts):
        raise ParallelConfigError(
            f"{what}: sections {parts} must be non-negative and add up to the dim size {size}"
        )
    for p in parts:
        if p % world != 0:
            raise ParallelConfigError(
                f"{what}: size {p} along the sharded dim is not divisible by the "
                f"{world} ranks it is split over"
            )
    return parts


def shard_tensor(
    full: torch.Tensor, dim: int, rank: int, world: int, sections: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's contiguous shard of ``full`` along ``dim`` (a copy, never a view)."""
    if world < 1 or not 0 <= rank < world:
        raise ParallelConfigError(f"shard_tensor: rank={rank} is outside [0, world={world})")
    dim = dim % full.dim()
    parts = _check_sections(full.shape[dim], world, sections, "shard_tensor")
    pieces, offset = [], 0
    for p in parts:
        step = p // world
        pieces.append(full.narrow(dim, offset + rank * step, step))
        offset += p
    return torch.cat(pieces, dim=dim).contiguous().clone()


def unshard_tensor(
    shards: Sequence[torch.Tensor], dim: int, sections: Sequence[int] | None = None
) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from every rank's shard, in rank order."""
    world = len(shards)
    if world == 0:
        raise ParallelConfigError("unshard_tensor: needs at least one shard")
    dim = dim % shards[0].dim()
    shard_size = shards[0].shape[dim]
    if any(s.shape != shards[0].shape for s in shards):
        raise ParallelConfigError(
            f"unshard_tensor: shards have different shapes {[tuple(s.shape) for s in shards]}"
        )
    parts = _check_sections(shard_size * world, world, sections, "unshard_tensor")
    steps = [p // world for p in parts]
    split = [torch.split(s, steps, dim=dim) for s in shards]
    # Section i of the full tensor is section i of every rank, concatenated in rank order.
    return torch.cat([split[r][i] for i in range(len(parts)) for r in range(world)], dim=dim)


def gather_full(
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    dim: int,
    sections: Sequence[int] | None = None,
) -> torch.Tensor:
    """All-gather every rank's shard over ``group`` and rebuild the full tensor (no autograd)."""
    world = dist.get_world_size(group)
    with torch.no_grad():
        shard = shard.detach().contiguous()
        if world == 1:
            return unshard_tensor([shard.clone()], dim, sections)
        gathered = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(gathered, shard, group=group)
        return unshard_tensor(gathered, dim, sections)


# -- expert parameters: stacked over the local experts, sharded over ep along dim 0 -------------

_EXPERT_ATTR = "_nanotron_expert_shard"


@dataclass(frozen=True)
class ExpertShard:
    """An expert parameter [E_local, ...] holds the global experts
    [first_local_expert, first_local_expert + E_local) of the full [num_experts, ...] tensor:
    ep rank `ep_rank` of `ep_size` holds the `ep_rank`-th contiguous block. Its gradient reduces
    over the edp x cp group (the ranks holding the same experts), not dp x cp; checkpoints
    store it by global expert index (the full tensor)."""

    num_experts: int
    first_local_expert: int
    num_local_experts: int

    @property
    def ep_size(self) -> int:
        return self.num_experts // self.num_local_experts

    @property
    def ep_rank(self) -> int:
        return self.first_local_expert // self.num_local_experts

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        return (self.num_experts, *local_shape[1:])


def mark_expert_param(param: torch.Tensor, num_experts: int, first_local_expert: int) -> None:
    """Mark `param` ([E_local, ...], stacked over this rank's experts) as an expert parameter
    holding global experts [first_local_expert, first_local_expert + E_local)."""
    local = int(param.shape[0])
    if local < 1 or num_experts % local or first_local_expert % local:
        raise ParallelConfigError(
            f"expert parameter of {local} local experts cannot hold experts from "
            f"{first_local_expert} of {num_experts} in equal contiguous blocks"
        )
    setattr(param, _EXPERT_ATTR, ExpertShard(num_experts, first_local_expert, local))


def expert_shard(param: torch.Tensor) -> ExpertShard | None:
    """The expert marker of `param`; None for a dense parameter."""
    return getattr(param, _EXPERT_ATTR, None)


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether `param` is a routed expert's weight (its gradient reduces over edp x cp)."""
    return expert_shard(param) is not None
