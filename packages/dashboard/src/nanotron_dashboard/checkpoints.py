"""Checkpoints found on disk (checkpoint_metadata.json, JSON only) and their resume commands."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

METADATA_FILE = "checkpoint_metadata.json"


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


def scan_checkpoints(checkpoints_path: str, cwd: str | None) -> list[DiskCheckpoint]:
    """Every `<checkpoints_path>/<step>/checkpoint_metadata.json`; unreadable ones are skipped.

    A checkpoint is complete when its metadata (written last) lists files that all exist with
    the recorded sizes. Hashes are not checked here: that would read gigabytes per page view.
    """
    root = resolve_dir(checkpoints_path, cwd)
    found: list[DiskCheckpoint] = []
    if not root.is_dir():
        return found
    for sub in root.iterdir():
        meta_file = sub / METADATA_FILE
        if not sub.name.isdigit() or not meta_file.is_file():
            continue
        try:
            meta = json.loads(meta_file.read_text())
            step = int(meta.get("step", sub.name))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        files = meta.get("files") or []
        size, complete = 0, True
        for f in files if isinstance(files, list) else []:
            try:
                fp = sub / f["path"]
                actual = fp.stat().st_size
                size += actual
                if f.get("size") is not None and int(f["size"]) != actual:
                    complete = False
            except (OSError, KeyError, TypeError, ValueError):
                complete = False
        created = meta.get("created")
        found.append(
            DiskCheckpoint(
                step=step,
                path=str(sub),
                consumed_tokens=meta.get("consumed_tokens"),
                topology=meta.get("topology") or {},
                size=size,
                complete=complete,
                created=created if isinstance(created, (int, float)) else None,
            )
        )
    return sorted(found, key=lambda c: c.step)


def resume_argv(command: list[str], checkpoint_path: str) -> list[str]:
    """The recorded command line with `--resume <path>` (replacing an earlier --resume)."""
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
    return [*out, "--resume", checkpoint_path]


def resume_command(command: list[str], checkpoint_path: str) -> str:
    return shlex.join(resume_argv(command, checkpoint_path))


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
    """A run started with `--resume P` where P is a listed checkpoint links to that run."""
    target = resume_target(command)
    if not target or target == "latest":
        return None, None
    want = str(resolve_dir(target, cwd).resolve())
    rows = conn.execute(
        text(
            "SELECT r.id, r.cwd, c.path, c.step FROM checkpoints c JOIN runs r ON r.pk = c.run_pk "
            "WHERE r.id != :id"
        ),
        {"id": run_id},
    ).fetchall()
    for rid, rcwd, path, step in rows:
        if str(resolve_dir(path, rcwd).resolve()) == want:
            return rid, step
    return None, None
