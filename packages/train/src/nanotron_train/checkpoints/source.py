"""Read tensors out of a saved checkpoint for any target layout.

The index comes from the safetensors headers only (cheap). A target shard is then either a
straight copy (same tp layout) or rebuilt: full tensor = unshard over the old tp ranks (ZeRO
ranges first concatenated over the old dp ranks), vocab padding rows fitted to the new tp,
then cut with shard_tensor for the new rank. Files are verified (size, sha256) when first read.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanotron_parallel.sharding import shard_tensor, unshard_tensor
from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.layout import ShardInfo, model_file, optimizer_file, piece_key
from nanotron_train.checkpoints.safetensors_io import load_tensors, read_header


def optimizer_ranks(topo: dict) -> list[int]:
    """The dp_cp ranks that wrote optimizer files: ZeRO shards over dp x cp (every rank);
    unsharded, dp_cp rank 0 and, under expert parallelism, the first replica of each ep rank
    (dp_rank = ep_rank, cp_rank 0: dp_cp rank ep_rank * cp) for its experts. cp and ep are 1
    where absent."""
    cp, ep = topo.get("cp", 1), topo.get("ep", 1)
    if topo.get("zero_stage", 0):
        return list(range(topo["dp"] * cp))
    return [e * cp for e in range(ep)]


@dataclass
class _Piece:
    file: str
    start: int
    end: int


@dataclass
class CheckpointSource:
    folder: Path
    metadata: dict
    # name -> {old tp rank: (file, ShardInfo)}
    model: dict[str, dict[int, tuple[str, ShardInfo]]] = field(default_factory=dict)
    # name -> {old tp rank: pieces sorted by start}; ShardInfo per (name, tp rank)
    pieces: dict[str, dict[int, list[_Piece]]] = field(default_factory=dict)
    piece_info: dict[tuple[str, int], ShardInfo] = field(default_factory=dict)
    adam_step: int = 0
    has_master: bool = False
    _cache: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @staticmethod
    def open(folder: Path, metadata: dict) -> CheckpointSource:
        src = CheckpointSource(folder, metadata)
        records = {r["path"]: r for r in metadata["files"]}
        topo = metadata["topology"]
        for p in range(topo["pp"]):
            for t in range(topo["tp"]):
                rel = model_file(p, t)
                src._require(rel, records)
                _, ours = read_header(folder / rel)
                for name, info in ours.get("params", {}).items():
                    src.model.setdefault(name, {})[t] = (rel, ShardInfo.from_dict(info))
                for d in optimizer_ranks(topo):
                    rel = optimizer_file(p, t, d)
                    src._require(rel, records)
                    entries, ours = read_header(folder / rel)
                    src.adam_step = max(src.adam_step, int(ours.get("adam_step", 0)))
                    src.has_master |= any(k.endswith(":master") for k in entries)
                    for name, info in ours.get("params", {}).items():
                        src.piece_info[(name, t)] = ShardInfo.from_dict(info)
                    for name, start, end in ours.get("pieces", []):
                        src.pieces.setdefault(name, {}).setdefault(t, []).append(
                            _Piece(rel, start, end)
                        )
        for by_tp in src.pieces.values():
            for lst in by_tp.values():
                lst.sort(key=lambda x: x.start)
        return src

    def _require(self, rel: str, records: dict) -> None:
        if rel not in records:
            raise CheckpointError(
                f"{self.folder / rel}: missing shard (not in {self.folder.name}'s metadata)"
            )
        if not (self.folder / rel).is_file():
            raise CheckpointError(f"{self.folder / rel}: missing file")

    def tensors(self, rel: str) -> dict[str, torch.Tensor]:
        if rel not in self._cache:
            records = {r["path"]: r for r in self.metadata["files"]}
            self._cache[rel], _ = load_tensors(self.folder / rel, records.get(rel))
        return self._cache[rel]

    def prefetch(
        self, rels: list[str], into: dict[str, dict[str, torch.Tensor]] | None = None
    ) -> None:
        """Read and verify several files at once: reads and sha256 run in threads (both release
        the GIL), so checksumming a large checkpoint uses more than one core. `into` offers, per
        file, tensors to read the bytes straight into (see safetensors_io.load_tensors)."""
        into = into or {}
        todo = [r for r in rels if r not in self._cache and (self.folder / r).is_file()]
        if not todo:
            return
        records = {r["path"]: r for r in self.metadata["files"]}

        def load(rel: str) -> dict[str, torch.Tensor]:
            return load_tensors(self.folder / rel, records.get(rel), into.get(rel))[0]

        # The biggest file first: its checksum is the longest single pass.
        todo.sort(key=lambda r: -int(records.get(r, {}).get("size", 0)))
        with ThreadPoolExecutor(min(len(todo), 4)) as pool:
            self._cache.update(zip(todo, pool.map(load, todo)))

    def release(self) -> None:
        self._cache.clear()

    def _get(self, rel: str, key: str) -> torch.Tensor:
        t = self.tensors(rel).get(key)
        if t is None:
            raise CheckpointError(f"{self.folder / rel}: tensor {key} is missing")
        return t

    # --- model weights ---------------------------------------------------------------
    def model_shard(self, name: str, target: ShardInfo) -> torch.Tensor:
        by_tp = self.model.get(name)
        if not by_tp:
            raise CheckpointError(f"{self.folder}: no shard holds parameter {name}")
        return _reshard(
            name,
            {t: (lambda rel=rel: self._get(rel, name)) for t, (rel, _) in by_tp.items()},
            {t: info for t, (_, info) in by_tp.items()},
            target,
            self.folder,
        )

    # --- optimizer state ---------------------------------------------------------------
    def has_state(self, kind: str) -> bool:
        return self.adam_step > 0 if kind != "master" else self.has_master

    def piece(self, name: str, kind: str, target: ShardInfo, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of this rank's flat tp shard of `name`'s `kind` state."""
        by_tp = self.pieces.get(name)
        if not by_tp:
            raise CheckpointError(f"{self.folder}: no optimizer shard holds {name}")
        infos = {t: self.piece_info[(name, t)] for t in by_tp}
        getters = {t: (lambda t=t: self._flat_shard(name, kind, t, infos[t])) for t in by_tp}
        return _reshard(name, getters, infos, target, self.folder).reshape(-1)[start:end]

    def _flat_shard(self, name: str, kind: str, tp: int, info: ShardInfo) -> torch.Tensor:
        """The old tp rank's whole shard of a state: its ZeRO ranges concatenated over dp."""
        parts, pos = [], 0
        for pc in self.pieces[name][tp]:
            if pc.start != pos:
                raise CheckpointError(
                    f"{self.folder / pc.file}: optimizer ranges of {name} leave a gap at {pos}"
                )
            parts.append(self._get(pc.file, piece_key(name, pc.start, pc.end, kind)).reshape(-1))
            pos = pc.end
        numel = 1
        for s in info.shape:
            numel *= s
        if pos != numel:
            raise CheckpointError(
                f"{self.folder}: optimizer ranges of {name} cover {pos} of {numel} elements"
            )
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # one range: a view, no copy
        return flat.view(info.shape)


def _reshard(
    name, getters, infos: dict[int, ShardInfo], target: ShardInfo, folder: Path
) -> torch.Tensor:
    any_info = next(iter(infos.values()))
    if not any_info.sharded:
        full = getters[min(getters)]()
    elif any_info.tp_size == target.tp_size and any_info.full_shape == target.full_shape:
        return getters[target.tp_rank]()  # same tp layout: this rank's shard as saved
    else:
        missing = [r for r in range(any_info.tp_size) if r not in getters]
        if missing:
            raise CheckpointError(f"{folder}: parameter {name} lacks tp shards {missing}")
        dim = any_info.shard_dim
        full = unshard_tensor(
            [getters[r]() for r in range(any_info.tp_size)], dim, any_info.sections
        )
    full = _fit_rows(name, full, target.full_shape, folder)
    if not target.sharded:
        return full.reshape(target.shape)
    return shard_tensor(full, target.shard_dim, target.tp_rank, target.tp_size, target.sections)


def _fit_rows(name: str, full: torch.Tensor, shape: tuple[int, ...], folder: Path) -> torch.Tensor:
    """Vocab padding depends on tp: drop or add zero rows (padding rows are always zero)."""
    if tuple(full.shape) == tuple(shape):
        return full
    if tuple(full.shape[1:]) != tuple(shape[1:]) or len(shape) != full.dim():
        raise CheckpointError(
            f"{folder}: parameter {name} has shape {tuple(full.shape)}, the model needs {shape}"
        )
    if full.shape[0] > shape[0]:
        return full[: shape[0]]
    pad = torch.zeros(shape[0] - full.shape[0], *shape[1:], dtype=full.dtype)
    return torch.cat((full, pad), dim=0)
