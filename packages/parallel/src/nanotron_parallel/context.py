"""ParallelContext: the one object that owns every process group of a parallel run.

Its dimensions and group kinds come from the table in grid.py (rank grid (pp, dp, cp, tp),
tp fastest): for each dimension and each derived kind the context holds `<name>_group` and
`<name>_ranks`, for each dimension `<name>_size` and `<name>_rank`, and for each derived kind
its size and this rank's place in it. Parameters are replicated over cp as over dp, so
gradients are reduced (and ZeRO shards) over the flattened dp x cp group, `dp_cp_group`, whose
rank is ``dp_rank * cp + cp_rank``. Expert parallel splits dp into (edp, ep): `ep_group` holds
the ranks a MoE layer dispatches tokens over, `edp_cp_group` the ranks holding the same experts
(their gradients' reduction and ZeRO group; rank ``edp_rank * cp + cp_rank``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from nanotron_parallel.grid import (
    DERIVED_GROUPS,
    GRID_ORDER,
    GROUP_KINDS,
    ParallelConfigError,
    axis_sizes,
    check_degrees,
    coords_at,
    degrees,
    grid_coords,
    group_rank_lists,
    kind_rank_lists,
    rank_at,
    rank_grid,
    validate_degrees,
)

__all__ = [
    "ParallelConfigError",
    "ParallelContext",
    "collective_device",
    "grid_coords",
    "group_rank_lists",
    "rank_grid",
    "validate_degrees",
]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's tensors live: the current CUDA device under NCCL, else the CPU.
    (The one place that knows NCCL means CUDA.)"""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ParallelConfigError(f"environment variable {name} is required under torchrun")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ParallelConfigError(
            f"environment variable {name}={raw!r} is not an integer"
        ) from None


def store_attempt() -> str | None:
    """A store-key prefix for this torchrun attempt, equal on every rank; None without torchrun.

    Only torchrun's shared agent store outlives an attempt (stale addresses of dead ranks); its
    restart count is per agent, so a replacement node (restart count 0) joining a restarted one
    would disagree. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every rendezvous round gets a fresh
    store hosted by the new rank 0, so one constant prefix serves every node.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        return "0"
    return restart


class ParallelContext:
    """Process groups and coordinates of this rank for a (dp, tp, pp, cp) layout."""

    # Set from the grid table (grid.py), one of each per dimension or group kind:
    dp_size: int
    tp_size: int
    pp_size: int
    cp_size: int
    ep_size: int
    edp_size: int
    dp_cp_size: int
    edp_cp_size: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    ep_rank: int
    edp_rank: int
    dp_cp_rank: int
    edp_cp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    edp_cp_group: dist.ProcessGroup
    tp_ranks: list[int]
    dp_ranks: list[int]
    pp_ranks: list[int]
    cp_ranks: list[int]
    mp_ranks: list[int]
    dp_cp_ranks: list[int]
    ep_ranks: list[int]
    edp_cp_ranks: list[int]

    def __init__(
        self,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        backend: str | None = None,
        timeout: timedelta | None = None,
        tensor_collectives: bool | None = None,
        *,
        cp: int = 1,
        ep: int = 1,
    ) -> None:
        """`tensor_collectives`: run reduce-scatter and all-gather as the backend's
        single-tensor collectives (NCCL's way; None = only under NCCL). On gloo all-reduce +
        slice is faster, so that is the default there; tests set True to run NCCL's code paths
        (ZeRO-1's reduce-scatter and all-gather, sequence parallel's reduce-scatter) on the CPU.
        `cp`: the context-parallel degree (each sequence split over cp ranks); `ep`: the
        expert-parallel degree (a divisor of dp: experts split over ep consecutive dp ranks)."""
        self.sizes = degrees(dp, tp, pp, cp, ep)
        check_degrees(self.sizes)
        launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
        if dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
        elif launched:
            world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        else:
            world_size, rank = 1, 0
        # Validate everything before a single group exists.
        check_degrees(self.sizes, world_size)
        if not 0 <= rank < world_size:
            raise ParallelConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
        self.local_rank = _env_int("LOCAL_RANK", rank)
        already = dist.is_initialized()
        self.backend = dist.get_backend() if already else self._pick_backend(backend)
        self.device = (
            torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        )
        # Reuse a default group someone else made (and leave it to them to destroy).
        self._owns_default_group = not already
        # Every group gets the same timeout (new_group would otherwise use the backend's
        # default, 30 min for gloo, not the world's).
        self.timeout = timeout
        if not already:
            self._init_default_group(launched, rank, world_size, timeout)

        self.world_size, self.rank = world_size, rank
        if tensor_collectives is None:
            tensor_collectives = self.backend == "nccl"
        self.tensor_collectives = tensor_collectives
        self.world_group = dist.group.WORLD
        self._created_groups: list[dist.ProcessGroup] = []
        self._set_coordinates()
        self._make_groups()
        if self.backend == "nccl" and pp > 1:
            # NCCL needs every rank of a group in one collective before batched p2p between a
            # subset of them: one tiny all-reduce, once, instead of one per step.
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.pp_group)

    def _set_coordinates(self) -> None:
        """`<axis>_size` and `<axis>_rank` per grid axis; a derived kind's size and this rank's
        index in its group (dp: edp_rank * ep + ep_rank; dp_cp: dp_rank * cp + cp_rank)."""
        axes = axis_sizes(self.sizes)
        coords = coords_at(axes, self.rank)
        for name in GRID_ORDER:
            setattr(self, f"{name}_size", axes[name])
            setattr(self, f"{name}_rank", coords[name])
        for kind, spans in DERIVED_GROUPS.items():
            size, index = 1, 0
            for name in spans:
                size, index = size * axes[name], index * axes[name] + coords[name]
            setattr(self, f"{kind}_size", size)
            setattr(self, f"{kind}_rank", index)

    def _make_groups(self) -> None:
        """Every group of every kind, created in the same order on all ranks (creation is
        collective over the world); `<kind>_group` and `<kind>_ranks` are the ones holding
        this rank. A kind whose groups equal an earlier kind's (ep = 1: edp_cp is dp_cp)
        reuses those groups instead of creating them again."""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for kind, spans in GROUP_KINDS.items():
            for ranks in kind_rank_lists(self.sizes, spans):
                group = made.get(tuple(ranks))
                if group is None:
                    group = dist.new_group(ranks=ranks, timeout=self.timeout)
                    self._created_groups.append(group)
                    made[tuple(ranks)] = group
                if self.rank in ranks:
                    setattr(self, f"{kind}_group", group)
                    setattr(self, f"{kind}_ranks", ranks)

    # -- construction helpers ------------------------------------------------------------
    def _pick_backend(self, backend: str | None) -> str:
        if backend is None:
            return "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("nccl", "gloo"):
            raise ParallelConfigError(f"backend={backend!r} must be 'nccl' or 'gloo'")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ParallelConfigError("backend='nccl' needs CUDA, which is not available")
        return backend

    def _init_default_group(
        self, launched: bool, rank: int, world_size: int, timeout: timedelta | None
    ) -> None:
        kwargs = {} if timeout is None else {"timeout": timeout}
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        if launched:
            for key in ("MASTER_ADDR", "MASTER_PORT"):
                if key not in os.environ:
                    raise ParallelConfigError(
                        f"environment variable {key} is required under torchrun"
                    )
            restart = store_attempt()
            if restart is None:
                dist.init_process_group(
                    self.backend, init_method="env://", rank=rank, world_size=world_size, **kwargs
                )
                return
            # torchrun --max-restarts keeps one store for every attempt: without a prefix, a
            # restarted rank can read a dead rank's address left by the previous attempt.
            store, _, _ = next(dist.rendezvous("env://", rank, world_size, **kwargs))
            store = dist.PrefixStore(f"attempt{restart}", store)
            dist.init_process_group(
                self.backend, store=store, rank=rank, world_size=world_size, **kwargs
            )
        else:
            # A world of one still gets a real process group, so the same collectives run.
            store = dist.HashStore()
            dist.init_process_group(self.backend, store=store, rank=0, world_size=1, **kwargs)

    # -- rank arithmetic -----------------------------------------------------------------
    def coords_of(self, rank: int) -> tuple[int, int, int, int]:
        """(dp_rank, tp_rank, pp_rank, cp_rank) of a global rank."""
        return grid_coords(rank, self.dp_size, self.tp_size, self.pp_size, self.cp_size)

    def rank_of(
        self, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0
    ) -> int:
        """Global rank at the given coordinates."""
        coords = {"dp": dp_rank, "tp": tp_rank, "pp": pp_rank, "cp": cp_rank}
        for name in coords:
            value, size = coords[name], self.sizes[name]
            if not 0 <= value < size:
                raise ParallelConfigError(f"{name}_rank={value} is outside [0, {size})")
        return rank_at(self.sizes, coords)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage_rank(self) -> int | None:
        if self.is_first_stage:
            return None
        return self.rank_of(self.dp_rank, self.tp_rank, self.pp_rank - 1, self.cp_rank)

    @property
    def next_stage_rank(self) -> int | None:
        if self.is_last_stage:
            return None
        return self.rank_of(self.dp_rank, self.tp_rank, self.pp_rank + 1, self.cp_rank)

    # -- groups --------------------------------------------------------------------------
    def new_groups(self, rank_lists: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
        """Create every listed group (same order on all ranks); return the one holding us.

        Every rank of the world must call this with the same lists, since group creation is
        collective over the world.
        """
        normalised: list[list[int]] = []
        for ranks in rank_lists:
            ranks = sorted(int(r) for r in ranks)
            if not ranks or len(set(ranks)) != len(ranks):
                raise ParallelConfigError(f"group ranks {ranks} must be non-empty and unique")
            if ranks[0] < 0 or ranks[-1] >= self.world_size:
                raise ParallelConfigError(
                    f"group ranks {ranks} are outside [0, world_size={self.world_size})"
                )
            normalised.append(ranks)
        found: dist.ProcessGroup | None = None
        for ranks in normalised:
            group = dist.new_group(ranks=ranks, timeout=self.timeout)
            self._created_groups.append(group)
            if self.rank in ranks:
                if found is not None:
                    raise ParallelConfigError(f"rank {self.rank} is listed in two groups")
                found = group
        return found

    def destroy(self) -> None:
        """Destroy the groups this object made, and the default group if it made that too."""
        if not dist.is_initialized():
            self._created_groups.clear()
            return
        for group in self._created_groups:
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        self._created_groups.clear()
        if self._owns_default_group:
            dist.destroy_process_group()
            self._owns_default_group = False

    def __repr__(self) -> str:
        return (
            f"ParallelContext(rank={self.rank}/{self.world_size}, dp={self.dp_rank}/{self.dp_size}, "
            f"tp={self.tp_rank}/{self.tp_size}, pp={self.pp_rank}/{self.pp_size}, "
            f"cp={self.cp_rank}/{self.cp_size}, ep={self.ep_rank}/{self.ep_size}, "
            f"backend={self.backend})"
        )
