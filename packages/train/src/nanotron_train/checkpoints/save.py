"""Save a checkpoint: every rank writes its own shards in parallel, rank 0 seals the folder.

Order: all ranks write into `<root>/.tmp-<step>/` (each file fsynced, its size and sha256
noted) -> all_gather of the file records -> rank 0 writes checkpoint_metadata.json, fsyncs the
folders, renames `.tmp-<step>` to `<step>`, fsyncs the root, and replaces latest.txt. A crash
at any point leaves either the previous checkpoint named by latest.txt or the new one whole.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from nanotron_models.moe import moe_state_buffers
from nanotron_parallel.sharding import gather_full, is_expert_param
from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.files import (
    FileRecord,
    fsync_dir,
    replace_text_atomic,
    write_durable,
    write_text_durable,
)
from nanotron_train.checkpoints.layout import (
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    SLOW_WRITE_ENV,
    TMP_PREFIX,
    ShardInfo,
    expert_offset,
    is_stored_copy,
    list_dirs,
    model_file,
    optimizer_file,
    piece_key,
    rng_file,
    whole,
)
from nanotron_train.checkpoints.rng_state import rng_tensors
from nanotron_train.checkpoints.safetensors_io import save_tensors

log = logging.getLogger(__name__)


def _slow_write() -> None:
    delay = float(os.environ.get(SLOW_WRITE_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def expert_tensors(model: torch.nn.Module, pc) -> dict[str, torch.Tensor]:
    """Every expert parameter whole, [num_experts, ...] by global expert index, gathered over
    the ep group (collective over it: every rank with edp_cp_rank 0 calls it)."""
    out = {}
    for name, p in model.named_parameters():
        if is_expert_param(p):
            out[name] = gather_full(p, pc.ep_group, 0) if pc.ep_size > 1 else p.detach()
    return out


def model_tensors(
    model: torch.nn.Module, pc, experts: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """This (pp, tp) rank's parameter shards by global name, tied copies left out; expert
    parameters whole (`experts`, from expert_tensors)."""
    tensors, infos = {}, {}
    for name, p in model.named_parameters():
        if name in (experts or {}):
            tensors[name] = experts[name]
            infos[name] = whole(experts[name].shape, pc.tp_rank, pc.tp_size).to_dict()
        elif is_stored_copy(name, p):
            tensors[name] = p.detach()
            infos[name] = ShardInfo.of(p, pc.tp_rank, pc.tp_size).to_dict()
    for name, b in moe_state_buffers(model):  # sigmoid_bias routers' biases (not trained)
        tensors[name] = b.detach()
        infos[name] = ShardInfo.of(b, pc.tp_rank, pc.tp_size).to_dict()
    return tensors, infos


def optimizer_tensors(
    optimizer, pc, experts_only: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Adam moments (and fp32 masters of low-precision models) of this rank's pieces. An
    expert parameter's pieces are keyed by their range in the whole [num_experts, ...] tensor.
    `experts_only`: leave the dense pieces to another rank (unsharded: ep rank 0's)."""
    tensors: dict[str, torch.Tensor] = {}
    pieces, params, adam_step = [], {}, 0
    inner = optimizer.inner
    for pc_ in optimizer.pieces:
        expert = is_expert_param(pc_.param)
        if not is_stored_copy(pc_.name, pc_.param) or (experts_only and not expert):
            continue
        start, end = pc_.start + expert_offset(pc_.param), pc_.end + expert_offset(pc_.param)
        pieces.append([pc_.name, start, end])
        info = ShardInfo.of(pc_.param, pc.tp_rank, pc.tp_size)
        if expert:
            info = whole(info.full_shape, pc.tp_rank, pc.tp_size)
        params[pc_.name] = info.to_dict()
        state = inner.state.get(pc_.master, {}) if inner is not None else {}
        for kind in optimizer.state_kinds(pc_):  # Adam's moments, Muon's momentum
            if kind in state:
                tensors[piece_key(pc_.name, start, end, kind)] = state[kind]
        if "step" in state:
            adam_step = int(float(state["step"]))
        if pc_.is_copy:
            tensors[piece_key(pc_.name, start, end, "master")] = pc_.master
    meta = {"adam_step": adam_step, "pieces": pieces, "params": params}
    return tensors, {**meta, "optimizer": optimizer.settings()}  # each group's settings


def _agree(pc, error: str | None) -> None:
    """Every rank raises if any rank failed (so none hangs in a later collective)."""
    errors: list[str | None] = [None] * pc.world_size
    dist.all_gather_object(errors, error, group=pc.world_group)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def check_shared(root: Path, pc) -> None:
    """checkpoints.checkpoints_path_is_shared_file_system: true: every rank must see what rank
    0 writes under `root` (rank 0 seals each checkpoint alone). Collective; raises on every rank."""
    name = [f".shared-check-{os.getpid()}-{time.time_ns()}" if pc.rank == 0 else None]
    dist.broadcast_object_list(name, src=0, group=pc.world_group)
    marker = root / name[0]
    error = None
    if pc.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            marker.write_text("")
        except OSError as exc:
            error = f"{root}: cannot write there ({exc.strerror})"
    _agree(pc, error)
    seen = marker.exists()
    try:
        _agree(pc, None if seen else (
            f"{root}: checkpoints.checkpoints_path_is_shared_file_system is true but rank "
            f"{pc.rank} does not see rank 0's files there"
        ))  # fmt: skip
    finally:  # every rank has looked (the agreement is collective): the marker can go
        if pc.rank == 0:
            marker.unlink(missing_ok=True)


def clean_leftovers(root: Path) -> None:
    """Remove `.tmp-*` folders a crashed save left behind (they were never complete)."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX) and p.is_dir():
            log.warning("removing %s: an unfinished checkpoint save (crashed or killed)", p)
            print(f"warning: removing unfinished checkpoint save {p}", flush=True)
            shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(root: str | Path, state, cfg, pc, zero_stage: int) -> Path:
    """Write `state` (a TrainState) as `<root>/<step>/`; collective over every rank.

    On failure (disk full, permissions) every rank raises the same CheckpointError, the
    unfinished folder is removed and latest.txt still names the previous checkpoint.
    """
    root = Path(root)
    step = state.step
    tmp = root / f"{TMP_PREFIX}{step}"
    try:
        _save(root, tmp, snapshot(state, cfg, pc, zero_stage, copy=False), pc)
    except CheckpointError:
        if pc.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root / str(step)


def _save(root: Path, tmp: Path, snap: Snapshot, pc) -> None:
    error = None
    if pc.rank == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
        except OSError as exc:
            error = f"{tmp}: cannot remove an old unfinished save ({exc.strerror})"
    _agree(pc, error)
    records: list[FileRecord] = []
    try:
        records = write_snapshot(tmp, snap)
    except OSError as exc:
        error = f"{tmp}: writing the checkpoint failed ({exc})"
    _agree(pc, error)
    gathered: list[list[FileRecord] | None] = [None] * pc.world_size
    dist.all_gather_object(gathered, records, group=pc.world_group)
    if pc.rank == 0:
        files = [r for rank_records in gathered for r in rank_records or []]
        error = seal_or_error(root, tmp, snap, files)
    _agree(pc, error)


@dataclass
class Snapshot:
    """What one rank writes for one checkpoint, taken at the end of a step.

    `copy=True` (asynchronous saves) holds host copies of the tensors, so training may change
    the live ones while a background thread writes these.
    """

    step: int
    files: list[tuple[str, dict[str, torch.Tensor] | None, Any]]  # (path, tensors, meta|bytes)
    seal: dict[str, Any]  # the metadata fields rank 0 writes when sealing
    keep_last_n: int | None


def _host(tensors: dict[str, torch.Tensor], copy: bool) -> dict[str, torch.Tensor]:
    if not copy:
        return tensors
    return {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}


def snapshot(state, cfg, pc, zero_stage: int, copy: bool) -> Snapshot:
    files: list[tuple[str, dict[str, torch.Tensor] | None, Any]] = []
    # Replicas over dp and cp hold the same parameters: the first of each writes them; ZeRO
    # shards the optimizer over dp x cp, so its files are indexed by the dp_cp rank. Experts
    # differ over ep: gathered whole for the model file, and without ZeRO the first replica of
    # each ep rank writes its experts' optimizer pieces.
    experts = expert_tensors(state.model, pc) if pc.edp_cp_rank == 0 else None
    if pc.dp_cp_rank == 0:
        tensors, infos = model_tensors(state.model, pc, experts)
        meta = {"params": infos, "pp_rank": pc.pp_rank, "tp_rank": pc.tp_rank}
        files.append((model_file(pc.pp_rank, pc.tp_rank), _host(tensors, copy), meta))
    if zero_stage > 0 or pc.edp_cp_rank == 0:
        only = zero_stage == 0 and pc.dp_cp_rank != 0
        tensors, meta = optimizer_tensors(state.optimizer, pc, experts_only=only)
        path = optimizer_file(pc.pp_rank, pc.tp_rank, pc.dp_cp_rank)
        files.append((path, _host(tensors, copy), meta))
    rng, rng_meta = rng_tensors()  # fresh copies already: no host copy needed when async
    files.append((rng_file(pc.rank), rng, rng_meta))
    if pc.rank == 0:
        schedule = dataclasses.asdict(state.lr_schedule)
        files.append(("lr_schedule.json", None, json.dumps(schedule, indent=1).encode()))
        data = {
            "data": state.data.state_dict(),
            "consumed_samples": state.consumed_samples,
            "data_step_offset": state.data_step_offset,  # steps whose data a rollback skipped
            "spike_rollbacks": state.spike_rollbacks,  # each: steps and data batches skipped
        }
        files.append(("data_state.json", None, json.dumps(data, indent=1).encode()))
        raw = cfg.to_dict()  # Nanotron records the position in the saved config too
        raw["general"].update(step=state.step, consumed_train_samples=state.consumed_samples)
        text = yaml.safe_dump(raw, sort_keys=False)
        files.append(("config.yaml", None, text.encode()))
    seal = {
        "step": state.step,
        "consumed_samples": state.consumed_samples,
        "consumed_tokens": state.consumed_tokens,
        "topology": {
            "dp": pc.dp_size,
            "tp": pc.tp_size,
            "pp": pc.pp_size,
            "cp": pc.cp_size,
            "ep": pc.ep_size,
            "zero_stage": zero_stage,
        },
        "model_config": state.model.config.to_dict(),
        "run_id": getattr(state, "extra", {}).get("run_id"),  # set by the logging rank (seals)
    }
    return Snapshot(state.step, files, seal, cfg.checkpoints.keep_last_n)


def write_snapshot(tmp: Path, snap: Snapshot) -> list[FileRecord]:
    """This rank's files into `tmp` (each fsynced); raises OSError (e.g. disk full)."""
    records = []
    for rel, tensors, payload in snap.files:
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        _slow_write()
        if tensors is not None:
            records.append(save_tensors(path, tensors, payload, tmp))
        else:
            records.append(write_durable(path, [payload], tmp))
    return records


def seal_or_error(root: Path, tmp: Path, snap: Snapshot, files: list[FileRecord]) -> str | None:
    """Rank 0: seal; returns the error line instead of raising (the caller spreads it)."""
    final = root / str(snap.step)
    try:
        _seal(root, tmp, final, snap, files)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"{final}: sealing the checkpoint failed ({exc})"
    return None


def _seal(root: Path, tmp: Path, final: Path, snap: Snapshot, files) -> None:
    now = time.time()
    meta = {
        "format_version": FORMAT_VERSION,
        **snap.seal,
        "created": now,  # unix seconds (the dashboard reads a number); ISO text beside it
        "created_iso": datetime.fromtimestamp(now, timezone.utc).isoformat(),
        "files": sorted((r.to_dict() for r in files), key=lambda r: r["path"]),
    }
    for sub in ("model", "optimizer", "rng"):
        if (tmp / sub).is_dir():
            fsync_dir(tmp / sub)
    write_text_durable(tmp / METADATA_FILE, json.dumps(meta, indent=1), tmp)
    fsync_dir(tmp)
    old = root / f"{TMP_PREFIX}old-{snap.step}"
    if final.exists():  # the same step saved again (e.g. final save right after a resume)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    replace_text_atomic(root / LATEST_FILE, f"{snap.step}\n")
    shutil.rmtree(old, ignore_errors=True)
    keep = snap.keep_last_n
    if keep:
        for d in list_dirs(root)[:-keep]:
            if d != final:
                shutil.rmtree(d, ignore_errors=True)
