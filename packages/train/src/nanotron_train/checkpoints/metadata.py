"""checkpoint_metadata.json, read and checked before anything is loaded from the folder.

A checkpoint's metadata decides where a resumed run restarts, so an edited or damaged one must
not start training: every field used is type-checked, with one line naming the file and the
key. The step is an integer >= 0 and equals the folder's name (when the name is a number: a
folder copied under another name has nothing to compare with). The consumed counts are
integers >= 0, tokens at least samples, and equal to data_state.json's (both are written by
the same save). They are not compared with step x global batch: a resume may change the batch
size, after which that product is no longer the count.

A resume never writes over a checkpoint newer than the one it loaded: `check_no_newer` refuses
at the start, in one line, when the folder the run saves to holds a complete checkpoint of a
later step (its saves would reach that step and replace it, and keep_last_n could delete it).
Refusing up front was chosen over guarding each save: the run would otherwise train for hours
and then either overwrite good work or stop at that step.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.layout import KNOWN_FORMAT_VERSIONS, METADATA_FILE, list_dirs


def read_metadata(folder: Path) -> dict:
    """The folder's checkpoint_metadata.json, checked (CheckpointError naming file and key)."""
    path = folder / METADATA_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {folder} is not a complete checkpoint") from None
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: not valid JSON") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    version = meta.get("format_version")
    if version not in KNOWN_FORMAT_VERSIONS or isinstance(version, bool):
        known = " or ".join(map(str, KNOWN_FORMAT_VERSIONS))
        raise CheckpointError(f"{path}: format_version {version!r}, this code reads {known}")
    check_metadata(path, meta)
    return meta


def _int(path: Path, meta: dict, key: str, low: int = 0, section: str = "") -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise CheckpointError(
            f"{path}: {section}{key}: must be an integer >= {low}, got {value!r:.60}"
        )
    return value


def check_metadata(path: Path, meta: dict) -> None:
    step = _int(path, meta, "step")
    name = path.parent.name
    if name.isdigit() and int(name) != step:
        raise CheckpointError(f"{path}: step: {step} differs from the folder's name {name}")
    samples = _int(path, meta, "consumed_samples")
    tokens = _int(path, meta, "consumed_tokens")
    if tokens < samples:
        raise CheckpointError(
            f"{path}: consumed_tokens: {tokens} is fewer than consumed_samples {samples}"
        )
    topo = meta.get("topology")
    if not isinstance(topo, dict):
        raise CheckpointError(f"{path}: topology: expected an object, got {topo!r:.60}")
    for key in ("dp", "tp", "pp"):
        _int(path, topo, key, low=1, section="topology.")
    topo.setdefault("cp", 1)
    _int(path, topo, "cp", low=1, section="topology.")
    if topo.get("zero_stage") not in (0, 1, 2, 3):
        raise CheckpointError(f"{path}: topology.zero_stage: must be 0, 1, 2 or 3")
    if not isinstance(meta.get("model_config", {}), dict):
        raise CheckpointError(f"{path}: model_config: expected an object")
    files = meta.get("files")
    if not isinstance(files, list):
        raise CheckpointError(f"{path}: files: expected a list, got {files!r:.60}")
    for i, rec in enumerate(files):
        _check_record(path, i, rec)


def _check_record(path: Path, i: int, rec) -> None:
    ok = (
        isinstance(rec, dict)
        and isinstance(rec.get("path"), str)
        and isinstance(rec.get("size"), int)
        and not isinstance(rec.get("size"), bool)
        and rec["size"] >= 0
        and isinstance(rec.get("sha256"), str)
    )
    if not ok:
        raise CheckpointError(f"{path}: files.{i}: expected {{path, size >= 0, sha256}}")
    rel = PurePosixPath(rec["path"])
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise CheckpointError(f"{path}: files.{i}.path: {rec['path']!r:.80} is outside the folder")


def check_data_state(folder: Path, meta: dict, data: dict) -> None:
    """data_state.json and the metadata come from one save: their counts agree."""
    path = folder / "data_state.json"
    if not isinstance(data, dict) or not isinstance(data.get("data"), dict):
        raise CheckpointError(f"{path}: data: expected an object")
    recorded = data.get("consumed_samples", meta["consumed_samples"])
    if recorded != meta["consumed_samples"]:
        raise CheckpointError(
            f"{path}: consumed_samples: {recorded!r:.40} differs from {METADATA_FILE}'s "
            f"{meta['consumed_samples']}"
        )
    data.setdefault("data_step_offset", 0)
    _int(path, data, "data_step_offset")
    rollbacks = data.setdefault("spike_rollbacks", [])
    if not isinstance(rollbacks, list) or not all(
        isinstance(r, dict) and all(type(v) is int for v in r.values()) for r in rollbacks
    ):
        raise CheckpointError(f"{path}: spike_rollbacks: expected a list of objects of integers")


def check_no_newer(root: Path, folder: Path, step: int) -> str | None:
    """The refusal line when `root` (where this run saves) holds a checkpoint after `step`."""
    newer = [d for d in list_dirs(root) if int(d.name) > step and (d / METADATA_FILE).is_file()]
    if not newer:
        return None
    return (
        f"{root}: holds the checkpoint of step {newer[-1].name}, newer than {folder} (step "
        f"{step}) that this run resumes from, and saving would overwrite it: resume from the "
        "newest (--resume latest), or set checkpoints.checkpoints_path to another folder"
    )
