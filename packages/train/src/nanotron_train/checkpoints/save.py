"""Save a checkpoint: every rank writes its own shards in parallel, rank 0 seals the folder.

Order: all ranks write into `<root>/.tmp-<step>/` (each file fsynced, its size and sha256
noted) -> all_gather of the file records -> rank 0 writes checkpoint_metadata.json, fsyncs the
folders, renames `.tmp-<step>` to `<step>`, fsyncs the root, and replaces latest.txt. A crash
at any point leaves either the previous checkpoint named by latest.txt or the new one whole.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import random
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

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
    is_stored_copy,
    list_dirs,
    model_file,
    optimizer_file,
    piece_key,
    rng_file,
)
from nanotron_train.checkpoints.safetensors_io import save_tensors

log = logging.getLogger(__name__)


def _slow_write() -> None:
    delay = float(os.environ.get(SLOW_WRITE_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def model_tensors(model: torch.nn.Module, pc) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """This (pp, tp) rank's parameter shards by global name, tied copies left out."""
    tensors, infos = {}, {}
    for name, p in model.named_parameters():
        if is_stored_copy(name, p):
            tensors[name] = p.detach()
            infos[name] = ShardInfo.of(p, pc.tp_rank, pc.tp_size).to_dict()
    return tensors, infos


def optimizer_tensors(optimizer, pc) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Adam moments (and fp32 masters of low-precision models) of this rank's pieces."""
    tensors: dict[str, torch.Tensor] = {}
    pieces, params, adam_step = [], {}, 0
    inner = optimizer.inner
    for pc_ in optimizer.pieces:
        if not is_stored_copy(pc_.name, pc_.param):
            continue
        pieces.append([pc_.name, pc_.start, pc_.end])
        params[pc_.name] = ShardInfo.of(pc_.param, pc.tp_rank, pc.tp_size).to_dict()
        state = inner.state.get(pc_.master, {}) if inner is not None else {}
        for kind in ("exp_avg", "exp_avg_sq"):
            if kind in state:
                tensors[piece_key(pc_.name, pc_.start, pc_.end, kind)] = state[kind]
        if "step" in state:
            adam_step = int(float(state["step"]))
        if pc_.is_copy:
            tensors[piece_key(pc_.name, pc_.start, pc_.end, "master")] = pc_.master
    return tensors, {"adam_step": adam_step, "pieces": pieces, "params": params}


def rng_bytes() -> bytes:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _agree(pc, error: str | None) -> None:
    """Every rank raises if any rank failed (so none hangs in a later collective)."""
    errors: list[str | None] = [None] * pc.world_size
    dist.all_gather_object(errors, error, group=pc.world_group)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


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
    """Write `state` (a TrainState) as `<root>/<step>/`; collective over every rank."""
    root = Path(root)
    step = state.step
    tmp = root / f"{TMP_PREFIX}{step}"
    error = None
    if pc.rank == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            for sub in ("model", "optimizer", "rng"):
                (tmp / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = f"{tmp}: cannot create the checkpoint folder ({exc.strerror})"
    _agree(pc, error)
    records: list[FileRecord] = []
    try:
        records = _write_rank_files(tmp, state, cfg, pc, zero_stage)
    except OSError as exc:
        error = f"{tmp}: writing the checkpoint failed ({exc})"
    _agree(pc, error)
    gathered: list[list[FileRecord] | None] = [None] * pc.world_size
    dist.all_gather_object(gathered, records, group=pc.world_group)
    final = root / str(step)
    if pc.rank == 0:
        try:
            files = [r for rank_records in gathered for r in rank_records or []]
            _seal(root, tmp, final, state, cfg, pc, zero_stage, files)
        except OSError as exc:
            error = f"{final}: sealing the checkpoint failed ({exc})"
    _agree(pc, error)
    return final


def _write_rank_files(tmp: Path, state, cfg, pc, zero_stage: int) -> list[FileRecord]:
    records = []
    if pc.dp_rank == 0:
        _slow_write()
        tensors, infos = model_tensors(state.model, pc)
        meta = {"params": infos, "pp_rank": pc.pp_rank, "tp_rank": pc.tp_rank}
        records.append(save_tensors(tmp / model_file(pc.pp_rank, pc.tp_rank), tensors, meta, tmp))
    if zero_stage > 0 or pc.dp_rank == 0:
        _slow_write()
        tensors, meta = optimizer_tensors(state.optimizer, pc)
        path = tmp / optimizer_file(pc.pp_rank, pc.tp_rank, pc.dp_rank)
        records.append(save_tensors(path, tensors, meta, tmp))
    _slow_write()
    records.append(write_durable(tmp / rng_file(pc.rank), [rng_bytes()], tmp))
    if pc.rank == 0:
        schedule = dataclasses.asdict(state.lr_schedule)
        records.append(
            write_text_durable(tmp / "lr_schedule.json", json.dumps(schedule, indent=1), tmp)
        )
        data = {"data": state.data.state_dict(), "consumed_samples": state.consumed_samples}
        records.append(write_text_durable(tmp / "data_state.json", json.dumps(data, indent=1), tmp))
        raw = cfg.to_dict()  # Nanotron records the position in the saved config too
        raw["general"].update(step=state.step, consumed_train_samples=state.consumed_samples)
        text = yaml.safe_dump(raw, sort_keys=False)
        records.append(write_text_durable(tmp / "config.yaml", text, tmp))
    return records


def _seal(root: Path, tmp: Path, final: Path, state, cfg, pc, zero_stage, files) -> None:
    now = time.time()
    meta = {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "consumed_samples": state.consumed_samples,
        "consumed_tokens": state.consumed_tokens,
        "topology": {
            "dp": pc.dp_size,
            "tp": pc.tp_size,
            "pp": pc.pp_size,
            "zero_stage": zero_stage,
        },
        "created": now,  # unix seconds (the dashboard reads a number); ISO text beside it
        "created_iso": datetime.fromtimestamp(now, timezone.utc).isoformat(),
        "model_config": state.model.config.to_dict(),
        "run_id": getattr(state, "extra", {}).get("run_id"),  # set by the logging rank (seals)
        "files": sorted((r.to_dict() for r in files), key=lambda r: r["path"]),
    }
    for sub in ("model", "optimizer", "rng"):
        fsync_dir(tmp / sub)
    write_text_durable(tmp / METADATA_FILE, json.dumps(meta, indent=1), tmp)
    fsync_dir(tmp)
    old = root / f"{TMP_PREFIX}old-{state.step}"
    if final.exists():  # the same step saved again (e.g. final save right after a resume)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    replace_text_atomic(root / LATEST_FILE, f"{state.step}\n")
    shutil.rmtree(old, ignore_errors=True)
    keep = cfg.checkpoints.keep_last_n
    if keep:
        for d in list_dirs(root)[:-keep]:
            if d != final:
                shutil.rmtree(d, ignore_errors=True)
