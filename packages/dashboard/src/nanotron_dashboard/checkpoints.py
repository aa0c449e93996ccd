"""Checkpoints found on disk (checkpoint_metadata.json, JSON only) and their resume commands."""

from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from .paths import path_key, real_path
from .trainer_files import MAX_METADATA_BYTES, ParsedCache, Refused

METADATA_FILE = "checkpoint_metadata.json"
INT64_MAX = 2**63 - 1
MAX_FOLDERS = 10_000  # step folders looked at per scan
METADATA = ParsedCache()  # parsed metadata by file identity, shared by every run page


@dataclass
class DiskCheckpoint:
    step: int
    path: str
    consumed_tokens: int | None
    topology: dict[str, Any] = field(default_factory=dict)
    size: int | None = None
    complete: bool = False
    created: float | None = None


def resolve_dir(path: str, cwd: str | None) -> Path:
    p = Path(os.path.expanduser(path))
    if not p.is_absolute() and cwd:
        p = Path(cwd) / p
    return p


def _parse_metadata(data: bytes) -> dict[str, Any]:
    """What a listing needs from checkpoint_metadata.json, not the whole document."""
    meta = json.loads(data)
    if not isinstance(meta, dict):
        raise ValueError("not an object")
    files = meta.get("files")
    return {
        "step": meta.get("step"),
        "consumed_tokens": _int64(meta.get("consumed_tokens")),
        "topology": meta.get("topology") if isinstance(meta.get("topology"), dict) else {},
        "created": meta.get("created"),
        "files": files if isinstance(files, list) else None,
    }


def scan_checkpoints(checkpoints_path: str, cwd: str | None) -> list[DiskCheckpoint]:
    """Every `<checkpoints_path>/<step>/checkpoint_metadata.json`; unreadable ones are skipped.

    A checkpoint is complete when its metadata (written last) lists files that all exist with
    the recorded sizes. Hashes are not checked here: that would read gigabytes per page view.
    The metadata is read capped and cached (trainer_files.py); at most MAX_FOLDERS folders.
    """
    found: list[DiskCheckpoint] = []
    try:
        root = resolve_dir(checkpoints_path, cwd)
        with os.scandir(root) as it:
            subs = [Path(e.path) for _, e in zip(range(MAX_FOLDERS), it) if e.name.isdigit()]
    except (OSError, ValueError, RuntimeError):
        return found
    for sub in subs:
        try:
            meta = METADATA.get(sub / METADATA_FILE, root, _parse_metadata, MAX_METADATA_BYTES)
            step = int(meta["step"] if meta["step"] is not None else sub.name)
        except (OSError, Refused, ValueError, TypeError, RecursionError):
            continue
        if not 0 <= step <= INT64_MAX:
            continue
        size, complete = _files_size(sub, meta["files"])
        created = meta["created"]
        found.append(
            DiskCheckpoint(
                step=step,
                path=str(sub),
                consumed_tokens=meta["consumed_tokens"],
                topology=meta["topology"],
                size=size,
                complete=complete,
                created=created
                if isinstance(created, (int, float)) and math.isfinite(created)
                else None,
            )
        )
    return sorted(found, key=lambda c: c.step)


def _int64(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX else None


def _files_size(folder: Path, files: Any) -> tuple[int, bool]:
    """Total size of the files the metadata lists, and whether all exist with their sizes.

    A listed path must resolve inside the checkpoint's folder: metadata naming `/etc/shadow`
    or `../../x` makes the checkpoint incomplete, and that file is not even looked at.
    """
    size, complete = 0, True
    base = real_path(str(folder))
    if base is None:
        return 0, False
    for f in files if isinstance(files, list) else []:
        try:
            fp = real_path(str(folder / f["path"]))  # never raises: a loop is None
            if fp is None or not Path(fp).is_relative_to(base) or fp == base:
                complete = False
                continue
            actual = os.stat(fp).st_size
            size += actual
            if f.get("size") is not None and int(f["size"]) != actual:
                complete = False
        except (OSError, KeyError, TypeError, ValueError, AttributeError):
            complete = False
    return size, complete


BRANCH_SCAN_LIMIT = 10_000  # folder entries looked at for a newer checkpoint


def newest_complete_step(root: Path) -> int | None:
    """The latest step folder of `root` holding a complete checkpoint (its metadata is written
    last), looked at once per folder and listing; None when there is none."""
    newest = None
    try:
        with os.scandir(root) as entries:
            for i, entry in enumerate(entries):
                if i >= BRANCH_SCAN_LIMIT:
                    break
                if not entry.name.isdigit() or (newest is not None and int(entry.name) <= newest):
                    continue
                if os.path.isfile(os.path.join(entry.path, "checkpoint_metadata.json")):
                    newest = int(entry.name)
    except OSError:
        return None
    return newest


def resume_argv(command: list[str], checkpoint_path: str, newest_step: int | None) -> list[str]:
    """The recorded command line with `--resume <path>` (replacing an earlier --resume). From
    a checkpoint that a later one follows (`newest_step`: `newest_complete_step` of its
    folder), the resumed run saves into a sibling folder `<root>-from-<step>` (the trainer
    never writes over a newer checkpoint)."""
    out: list[str] = []
    skip = False
    for arg in command:
        if skip:
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        if arg.startswith("--resume="):
            continue
        out.append(arg)
    out += ["--resume", checkpoint_path]
    path = Path(checkpoint_path)
    if path.name.isdigit() and newest_step is not None and newest_step > int(path.name):
        branch = path.parent.with_name(f"{path.parent.name}-from-{path.name}")
        out += ["--override", f"checkpoints.checkpoints_path={branch}"]
    return out


def resume_command(command: list[str], checkpoint_path: str, newest_step: int | None) -> str:
    return shlex.join(resume_argv(command, checkpoint_path, newest_step))


def resume_target(command: list[str]) -> str | None:
    for i, arg in enumerate(command):
        if arg == "--resume" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--resume="):
            return arg.split("=", 1)[1]
    return None


def infer_resumed_from(
    conn: Connection, command: list[str], cwd: str | None, run_id: str
) -> tuple[str | None, int | None]:
    """A run started with `--resume P` where P is a listed checkpoint links to that run.

    Bounded whatever is stored: P is resolved once, and its parent found by the key of its
    resolved path (stored with each checkpoint and run, paths.py), two indexed lookups.
    A P that does not resolve (a loop, too deep) links to nothing."""
    target = resume_target(command)
    if not target or target == "latest":
        return None, None
    real = real_path(target, cwd)
    if real is None:
        return None, None
    row = conn.execute(
        text(
            "SELECT r.id, c.step FROM checkpoints c JOIN runs r ON r.pk = c.run_pk "
            "WHERE c.path_key = :k AND r.id != :id ORDER BY c.id LIMIT 1"
        ),
        {"k": path_key(real), "id": run_id},
    ).first()
    if row is not None:
        return row[0], row[1]
    # a checkpoint found on disk but not stored yet: `<checkpoints_path>/<step>` of a run
    folder, name = os.path.split(real)
    if not (name.isdecimal() and name.isascii() and int(name) <= INT64_MAX):
        return None, None
    row = conn.execute(
        text("SELECT id FROM runs WHERE checkpoints_key = :k AND id != :id ORDER BY pk LIMIT 1"),
        {"k": path_key(folder), "id": run_id},
    ).first()
    return (row[0], int(name)) if row is not None else (None, None)
