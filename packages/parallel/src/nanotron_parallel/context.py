"""ParallelContext: the one object that owns every process group of a parallel run.

The rank grid is (pp, dp, cp, tp) with tp fastest, so the ranks of one tp group are
consecutive and sit on one node, and a cp group (context parallel, which exchanges keys and
values every layer) is the next closest:
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``.
With cp = 1 this is the (pp, dp, tp) grid of a 3D-parallel run, rank for rank.

Parameters are replicated over cp as over dp, so gradients are reduced (and ZeRO shards)
over the flattened dp x cp group, `dp_cp_group`, whose rank is ``dp_rank * cp + cp_rank``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class ParallelConfigError(ValueError):
    """A parallel layout or shape that cannot work (names the offending numbers)."""


def _product_text(dp: int, tp: int, pp: int, cp: int) -> tuple[str, str]:
    """("dp*tp*pp", "dp=2 * tp=2 * pp=1"), with cp named only when it is not 1."""
    names = ("dp", "cp", "tp", "pp") if cp != 1 else ("dp", "tp", "pp")
    values = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
    return "*".join(names), " * ".join(f"{n}={values[n]}" for n in names)


def validate_degrees(dp: int, tp: int, pp: int, world_size: int | None = None, cp: int = 1) -> None:
    """Raise ParallelConfigError for a non-positive degree or dp*cp*tp*pp != world_size."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ParallelConfigError(
                f"parallelism degree {name}={value!r} must be a positive integer "
                f"(got dp={dp}, tp={tp}, pp={pp}, cp={cp})"
            )
    if world_size is not None and dp * cp * tp * pp != world_size:
        names, factors = _product_text(dp, tp, pp, cp)
        raise ParallelConfigError(
            f"{names} must equal the world size: {factors} = "
            f"{dp * cp * tp * pp}, but world_size={world_size}"
        )


def rank_grid(dp: int, tp: int, pp: int, cp: int = 1) -> list[list[list[list[int]]]]:
    """Global ranks as nested lists ``grid[pp_rank][dp_rank][cp_rank][tp_rank]`` (tp fastest)."""
    validate_degrees(dp, tp, pp, cp=cp)
    return [
        [
            [[((p * dp + d) * cp + c) * tp + t for t in range(tp)] for c in range(cp)]
            for d in range(dp)
        ]
        for p in range(pp)
    ]


def grid_coords(rank: int, dp: int, tp: int, pp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(dp_rank, tp_rank, pp_rank, cp_rank) of a global rank in the (pp, dp, cp, tp) grid
    (cp last, so the first three keep their places from the 3D grid)."""
    validate_degrees(dp, tp, pp, cp=cp)
    world = dp * cp * tp * pp
    if not 0 <= rank < world:
        raise ParallelConfigError(f"rank={rank} is outside [0, world_size={world})")
    return (rank // (tp * cp)) % dp, rank % tp, rank // (tp * cp * dp), (rank // tp) % cp


def group_rank_lists(dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of each kind ("tp", "dp", "pp", "mp", "cp", "dp_cp") as sorted global-rank
    lists. Each kind partitions the world."""
    g = rank_grid(dp, tp, pp, cp)
    P, D, C, T = range(pp), range(dp), range(cp), range(tp)
    return {
        "tp": [g[p][d][c] for p in P for d in D for c in C],
        "dp": [[g[p][d][c][t] for d in D] for p in P for c in C for t in T],
        "pp": [[g[p][d][c][t] for p in P] for d in D for c in C for t in T],
        # One model replica: every (pp, tp) rank that shares a dp_rank and a cp_rank.
        "mp": [sorted(g[p][d][c][t] for p in P for t in T) for d in D for c in C],
        "cp": [[g[p][d][c][t] for c in C] for p in P for d in D for t in T],
        # The gradient reduction: every rank holding the same parameters (same pp, tp).
        "dp_cp": [sorted(g[p][d][c][t] for d in D for c in C) for p in P for t in T],
    }


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


class ParallelContext:
    """Process groups and coordinates of this rank for a (dp, tp, pp, cp) layout."""

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
    ) -> None:
        """`tensor_collectives`: run reduce-scatter and all-gather as the backend's
        single-tensor collectives (NCCL's way; None = only under NCCL). On gloo all-reduce +
        slice is faster, so that is the default there; tests set True to run NCCL's code paths
        (ZeRO-1's reduce-scatter and all-gather, sequence parallel's reduce-scatter) on the CPU.
        `cp`: the context-parallel degree (each sequence split over cp ranks)."""
        validate_degrees(dp, tp, pp, cp=cp)
        launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
        if dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
        elif launched:
            world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        else:
            world_size, rank = 1, 0
        # Validate everything before a single group exists.
        validate_degrees(dp, tp, pp, world_size, cp=cp)
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
        self.dp_size, self.tp_size, self.pp_size, self.cp_size = dp, tp, pp, cp
        self.dp_rank, self.tp_rank, self.pp_rank, self.cp_rank = self.coords_of(rank)
        self.dp_cp_size, self.dp_cp_rank = dp * cp, self.dp_rank * cp + self.cp_rank
        self.world_group = dist.group.WORLD
        self._created_groups: list[dist.ProcessGroup] = []

        mine: dict[str, tuple[dist.ProcessGroup, list[int]]] = {}
        for kind, lists in group_rank_lists(dp, tp, pp, cp).items():
            for ranks in lists:
                group = dist.new_group(ranks=ranks, timeout=timeout)
                self._created_groups.append(group)
                if rank in ranks:
                    mine[kind] = (group, ranks)
        self.tp_group, self.tp_ranks = mine["tp"]
        self.dp_group, self.dp_ranks = mine["dp"]
        self.pp_group, self.pp_ranks = mine["pp"]
        self.mp_group, self.mp_ranks = mine["mp"]
        self.cp_group, self.cp_ranks = mine["cp"]
        self.dp_cp_group, self.dp_cp_ranks = mine["dp_cp"]
        if self.backend == "nccl" and pp > 1:
            # NCCL needs every rank of a group in one collective before batched p2p between a
            # subset of them: one tiny all-reduce, once, instead of one per step.
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.pp_group)

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
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
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
        for name, value, size in (
            ("dp_rank", dp_rank, self.dp_size),
            ("tp_rank", tp_rank, self.tp_size),
            ("pp_rank", pp_rank, self.pp_size),
            ("cp_rank", cp_rank, self.cp_size),
        ):
            if not 0 <= value < size:
                raise ParallelConfigError(f"{name}={value} is outside [0, {size})")
        return (
            (pp_rank * self.dp_size + dp_rank) * self.cp_size + cp_rank
        ) * self.tp_size + tp_rank

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
            f"cp={self.cp_rank}/{self.cp_size}, "
            f"backend={self.backend})"
        )
