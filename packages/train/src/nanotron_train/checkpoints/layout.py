"""Names of a checkpoint's files and how a parameter's shard is described in them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nanotron_parallel.sharding import ParamMeta, expert_shard, get_param_meta

FORMAT_VERSION = 2  # 2: RNG states in safetensors (rng_state.py); 1: pickled, still read
KNOWN_FORMAT_VERSIONS = (1, 2)
METADATA_FILE = "checkpoint_metadata.json"
LATEST_FILE = "latest.txt"
TMP_PREFIX = ".tmp-"
SLOW_WRITE_ENV = "NANOTRON_TEST_CKPT_SLOW_WRITE_S"  # tests: sleep between shard writes


def model_file(pp: int, tp: int) -> str:
    return f"model/pp{pp}_tp{tp}.safetensors"


def optimizer_file(pp: int, tp: int, dp: int) -> str:
    return f"optimizer/pp{pp}_tp{tp}_dp{dp}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng/rank{rank}.safetensors"


def legacy_rng_file(rank: int) -> str:
    """Format 1's RNG state (a torch.save pickle): read, never written."""
    return f"rng/rank{rank}.pt"


def piece_key(name: str, start: int, end: int, kind: str) -> str:
    return f"{name}:{start}:{end}:{kind}"


@dataclass(frozen=True)
class ShardInfo:
    """What rebuilds a parameter's full tensor: stored per tensor in the header metadata."""

    shape: tuple[int, ...]  # this shard's shape
    full_shape: tuple[int, ...]  # the full tensor (vocab rows padded for this tp size)
    shard_dim: int | None
    sections: tuple[int, ...] | None
    tp_rank: int
    tp_size: int

    @property
    def sharded(self) -> bool:
        return self.shard_dim is not None and self.tp_size > 1

    def to_dict(self) -> dict:
        return {
            "shape": list(self.shape),
            "full_shape": list(self.full_shape),
            "shard_dim": self.shard_dim,
            "sections": list(self.sections) if self.sections else None,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
        }

    @staticmethod
    def from_dict(d: dict) -> ShardInfo:
        return ShardInfo(
            tuple(d["shape"]),
            tuple(d["full_shape"]),
            d["shard_dim"],
            tuple(d["sections"]) if d.get("sections") else None,
            int(d["tp_rank"]),
            int(d["tp_size"]),
        )

    @staticmethod
    def of(param: torch.Tensor, tp_rank: int, tp_size: int) -> ShardInfo:
        """What this rank holds of `param`. An expert parameter (replicated over tp) is
        described as the ep shard it is, along dim 0 of the [num_experts, ...] tensor, in the
        rank/size fields: checkpoints store it whole (`whole`), so a load at any ep cuts it."""
        meta: ParamMeta | None = get_param_meta(param)
        shape = tuple(param.shape)
        experts = expert_shard(param)
        if experts is not None:
            full = experts.full_shape(shape)
            return ShardInfo(shape, full, 0, None, experts.ep_rank, experts.ep_size)
        if meta is None or meta.shard_dim is None:
            return ShardInfo(shape, shape, None, None, tp_rank, tp_size)
        return ShardInfo(
            shape, tuple(meta.full_shape), meta.shard_dim, meta.sections, tp_rank, tp_size
        )


def whole(shape: tuple[int, ...], tp_rank: int, tp_size: int) -> ShardInfo:
    """A tensor stored whole (an expert parameter reassembled over ep)."""
    return ShardInfo(tuple(shape), tuple(shape), None, None, tp_rank, tp_size)


def expert_offset(param: torch.Tensor) -> int:
    """Where `param`'s flat elements start in its full tensor: an expert parameter's local
    experts come after the first_local_expert experts before them; 0 for any other."""
    experts = expert_shard(param)
    if experts is None:
        return 0
    return experts.first_local_expert * (param.numel() // experts.num_local_experts)


def canonical_name(name: str, param: torch.Tensor) -> str:
    """The name a parameter is stored under: a tied copy uses its tied key (stored once)."""
    meta = get_param_meta(param)
    return meta.tied_key if meta is not None and meta.tied_key else name


def is_stored_copy(name: str, param: torch.Tensor) -> bool:
    """True for the copy that gets written (not a tied copy living under another name)."""
    return canonical_name(name, param) == name


def list_dirs(root: Path) -> list[Path]:
    """Complete-looking step folders under a checkpoints root, oldest first."""
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(steps, key=lambda p: int(p.name))
