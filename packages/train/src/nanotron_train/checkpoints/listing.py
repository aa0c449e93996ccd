"""`python -m nanotron_train.checkpoints list PATH [--json]`: what a checkpoints folder holds.

A checkpoint is complete when its checkpoint_metadata.json (written last) exists and every file
it lists has the recorded size; checksums are not read here (that would read every byte).
Unfinished saves (`.tmp-<step>`) are listed as incomplete.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.layout import LATEST_FILE, METADATA_FILE, TMP_PREFIX
from nanotron_train.reporting.sizes import format_bytes


@dataclass
class CheckpointEntry:
    step: int
    path: str
    complete: bool
    consumed_tokens: int | None = None
    consumed_samples: int | None = None
    topology: dict = field(default_factory=dict)
    size: int = 0
    created: float | None = None
    latest: bool = False
    problem: str | None = None


def _entry(folder: Path, step: int) -> CheckpointEntry:
    entry = CheckpointEntry(step=step, path=str(folder), complete=False)
    on_disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    entry.size = on_disk
    try:
        meta = json.loads((folder / METADATA_FILE).read_text())
    except FileNotFoundError:
        entry.problem = f"no {METADATA_FILE} (unfinished save)"
        return entry
    except ValueError:
        entry.problem = f"{METADATA_FILE} is not valid JSON"
        return entry
    entry.consumed_tokens = meta.get("consumed_tokens")
    entry.consumed_samples = meta.get("consumed_samples")
    entry.topology = meta.get("topology") or {}
    entry.created = meta.get("created")
    bad = []
    for rec in meta.get("files", []):
        p = folder / rec["path"]
        if not p.is_file() or p.stat().st_size != rec["size"]:
            bad.append(rec["path"])
    entry.complete = not bad
    entry.problem = f"missing or wrong size: {', '.join(bad)}" if bad else None
    return entry


def list_checkpoints(root: str | Path) -> list[CheckpointEntry]:
    """Every checkpoint (and unfinished save) under `root`, by step."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoints folder")
    latest_file = root / LATEST_FILE
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    out = []
    for d in root.iterdir():
        name = d.name.removeprefix(TMP_PREFIX)
        if d.is_dir() and name.isdigit():
            e = _entry(d, int(name))
            e.latest = d.name == latest
            if d.name.startswith(TMP_PREFIX):
                e.complete, e.problem = False, "unfinished save (temporary folder)"
            out.append(e)
    return sorted(out, key=lambda e: (e.step, e.path))


def to_json(entries: list[CheckpointEntry]) -> str:
    return json.dumps([asdict(e) for e in entries], indent=1)


def _size(n: int) -> str:
    return format_bytes(n)  # binary units, labelled MiB, as everywhere the trainer prints


def to_table(entries: list[CheckpointEntry]) -> str:
    lines = [f"{'step':>8}  {'tokens':>12}  {'dp,cp,tp,pp,zero':<16} {'size':>10}  status"]
    for e in entries:
        t = {"cp": 1, **e.topology}  # cp: 1 before context parallelism was recorded
        keys = ("dp", "cp", "tp", "pp", "zero_stage")
        topo = ",".join(str(t.get(k, "?")) for k in keys) if e.topology else "-"
        if t.get("ep", 1) != 1:  # expert parallel, inside dp: named only where used
            topo += f",ep={t['ep']}"
        status = "complete" if e.complete else f"INCOMPLETE: {e.problem}"
        if e.latest:
            status += " (latest)"
        tokens = "-" if e.consumed_tokens is None else str(e.consumed_tokens)
        lines.append(f"{e.step:>8}  {tokens:>12}  {topo:<16} {_size(e.size):>10}  {status}")
    return "\n".join(lines)
