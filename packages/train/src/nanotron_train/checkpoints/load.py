"""Resume from a checkpoint, in the layout it was saved with or any other.

Every rank reads what its own shards need (verified against the sizes and checksums in
checkpoint_metadata.json), so nothing is gathered on one rank. With the same layout the run
continues bitwise (RNG states too); under another layout weights and Adam state are rebuilt
exactly, the data position carries over in samples, and the RNGs are reseeded from
(seed, step) because per-rank streams have no meaning in a different world.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from nanotron_models.families import family_of
from nanotron_models.moe import moe_state_buffers
from nanotron_parallel.sharding import is_expert_param
from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.files import read_verified
from nanotron_train.checkpoints.layout import (
    LATEST_FILE,
    METADATA_FILE,
    ShardInfo,
    canonical_name,
    is_stored_copy,
    model_file,
    optimizer_file,
    piece_key,
)
from nanotron_train.checkpoints.metadata import check_data_state, read_metadata
from nanotron_train.checkpoints.rng_state import load_rng, reseed
from nanotron_train.checkpoints.save import _agree
from nanotron_train.checkpoints.source import CheckpointSource
from nanotron_train.lr_schedule import LRSchedule

# An optional architecture field left off: unset on both sides counts as the same.
_UNSET = (None, False)


def resolve_checkpoint(value: str, checkpoints_path: str | None) -> Path:
    """`latest`, a checkpoints root (uses its latest.txt) or one step folder -> the step folder."""
    if value in ("latest", "auto"):
        if not checkpoints_path:
            raise CheckpointError(
                f"--resume {value} needs checkpoints.checkpoints_path in the config"
            )
        path = Path(checkpoints_path)
    else:
        path = Path(value)
    if (path / METADATA_FILE).is_file():
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        step = latest.read_text().strip()
        if not step.isdigit():
            raise CheckpointError(f"{latest}: does not hold a step number ({step[:40]!r})")
        return path / step
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or checkpoints folder")
    raise CheckpointError(
        f"{path}: not a complete checkpoint (no {METADATA_FILE}) and no {LATEST_FILE}"
    )


def check_files(folder: Path, meta: dict) -> None:
    """Every listed file exists with its recorded size (checksums are checked on read)."""
    for rec in meta["files"]:
        path = folder / rec["path"]
        if not path.is_file():
            raise CheckpointError(f"{path}: missing file (listed in {METADATA_FILE})")
        size = path.stat().st_size
        if size < rec["size"]:
            raise CheckpointError(f"{path}: truncated ({size} of {rec['size']} bytes)")
        if size != rec["size"]:
            raise CheckpointError(
                f"{path}: size mismatch ({size} bytes, metadata says {rec['size']})"
            )


def check_model_config(folder: Path, meta: dict, model_config) -> None:
    """The checkpoint's model is the config's: the fields that change the parameters or the
    maths (the family's `arch_keys`, and its `optional_arch_keys` where either side sets
    them) agree; the rest (kernels, token ids) may differ."""
    saved, mine = meta.get("model_config") or {}, model_config.to_dict()
    row = family_of(model_config)
    diff = [
        f"{k}: checkpoint {saved.get(k)!r}, config {mine.get(k)!r}"
        for k in row.arch_keys
        if saved.get(k) != mine.get(k)
    ] + [
        f"{k}: checkpoint {saved.get(k)!r}, config {mine.get(k)!r}"
        for k in row.optional_arch_keys
        if saved.get(k) != mine.get(k) and not (saved.get(k) in _UNSET and mine.get(k) in _UNSET)
    ]
    if diff:
        raise CheckpointError(
            f"{folder / METADATA_FILE}: model config does not match ({'; '.join(diff)})"
        )


def _json(folder: Path, meta: dict, rel: str) -> dict:
    records = {r["path"]: r for r in meta["files"]}
    return json.loads(bytes(read_verified(folder / rel, records.get(rel))))


def load_checkpoint(folder: str | Path, state, cfg, pc, zero_stage: int) -> dict:
    """Fill `state` (a TrainState) from the checkpoint; collective; returns its metadata."""
    folder = Path(folder)
    error, meta = None, {}
    try:
        meta = _load(folder, state, cfg, pc, zero_stage)
    except CheckpointError as exc:
        error = str(exc)
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
        # e.g. a data state that does not fit the data: still one line naming the folder
        line = (str(exc).strip().splitlines() or [""])[0][:300]
        error = f"{folder}: unreadable checkpoint ({type(exc).__name__}: {line})"
    _agree(pc, error)
    return meta


def _load(folder: Path, state, cfg, pc, zero_stage: int) -> dict:
    meta = read_metadata(folder)
    check_model_config(folder, meta, state.model.config)
    check_files(folder, meta)
    topo = meta["topology"]
    saved = (topo["dp"], topo["tp"], topo["pp"], topo.get("cp", 1), topo.get("ep", 1))
    same = saved == (pc.dp_size, pc.tp_size, pc.pp_size, pc.cp_size, pc.ep_size)
    src = CheckpointSource.open(folder, meta)
    own = [
        model_file(pc.pp_rank, pc.tp_rank),
        optimizer_file(pc.pp_rank, pc.tp_rank, pc.dp_cp_rank),
    ]
    if same:  # exactly this rank's shards, read straight into the tensors they restore
        src.prefetch(own, _destinations(state, cfg, pc, own))
    _load_model(src, state.model, pc)
    if cfg.checkpoints.load_optimizer:
        _load_optimizer(src, state.optimizer, pc)
    src.release()
    if cfg.checkpoints.load_lr_scheduler:
        state.lr_schedule = LRSchedule(**_json(folder, meta, "lr_schedule.json"))
    data = _json(folder, meta, "data_state.json")
    check_data_state(folder, meta, data)
    state.data.load_state_dict(data["data"])
    state.data_step_offset = int(data.get("data_step_offset", 0))
    state.spike_rollbacks = data["spike_rollbacks"]  # checked: a list of integer records
    state.step = int(meta["step"])
    state.consumed_samples = int(meta["consumed_samples"])
    state.consumed_tokens = int(meta["consumed_tokens"])
    if same:
        load_rng(folder, pc.rank, {r["path"]: r for r in meta["files"]})
    else:
        reseed(cfg.general.seed + state.step)
    return meta


def _destinations(state, cfg, pc, own: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Same layout: the live tensors each of this rank's files restores, by stored name.

    Reading into them saves a staging buffer (fresh memory costs a page fault per 4 KiB) and a
    copy. A checksum error after such a read leaves them unverified, which is why a failed
    load_checkpoint is fatal for its caller (the trainer exits on it).
    """
    model = {
        name: p
        for name, p in state.model.named_parameters()
        if is_stored_copy(name, p) and not is_expert_param(p)  # experts: stored whole
    }
    optim: dict[str, torch.Tensor] = {}
    inner = state.optimizer.inner
    for piece in state.optimizer.pieces if cfg.checkpoints.load_optimizer else []:
        if not is_stored_copy(piece.name, piece.param) or is_expert_param(piece.param):
            continue
        key = functools.partial(piece_key, piece.name, piece.start, piece.end)
        if piece.is_copy:
            optim[key("master")] = piece.master
        held = inner.state.get(piece.master, {}) if inner is not None else {}
        for kind in state.optimizer.state_kinds(piece):
            if isinstance(held.get(kind), torch.Tensor):
                optim[key(kind)] = held[kind]
    return {own[0]: model, own[1]: optim}


@torch.no_grad()
def _load_model(src: CheckpointSource, model: torch.nn.Module, pc) -> None:
    for name, p in model.named_parameters():
        target = ShardInfo.of(p, pc.tp_rank, pc.tp_size)
        shard = src.model_shard(canonical_name(name, p), target)
        if shard.data_ptr() != p.data_ptr() or shard.dtype != p.dtype:  # else read in place
            p.copy_(shard.to(p.dtype))
    for name, b in moe_state_buffers(model):  # absent from a checkpoint of a softmax router
        if src.model.get(name):
            b.copy_(src.model_shard(name, ShardInfo.of(b, pc.tp_rank, pc.tp_size)))


@torch.no_grad()
def _load_optimizer(src: CheckpointSource, optimizer, pc) -> None:
    inner = optimizer.inner
    for piece in optimizer.pieces:
        name = canonical_name(piece.name, piece.param)
        target = ShardInfo.of(piece.param, pc.tp_rank, pc.tp_size)
        if src.has_state("master"):
            master = src.piece(name, "master", target, piece.start, piece.end)
            if master.data_ptr() != piece.master.data_ptr():  # else it was read in place
                piece.master.copy_(master)
        elif piece.is_copy:
            full = src.model_shard(name, target).reshape(-1)[piece.start : piece.end]
            piece.master.copy_(full.to(piece.master.dtype))
        if inner is None or not src.has_state("exp_avg"):
            continue
        fused = bool(inner.param_groups[0].get("fused"))
        step = torch.tensor(float(src.adam_step), dtype=torch.float32)
        # Already the held moments when they were read in place; else the tensors read.
        moments = {
            kind: src.piece(name, kind, target, piece.start, piece.end)
            .to(piece.master)
            .contiguous()
            for kind in optimizer.state_kinds(piece)
        }
        inner.state[piece.master] = {
            "step": step.to(piece.master.device) if fused else step,
            **moments,
        }
