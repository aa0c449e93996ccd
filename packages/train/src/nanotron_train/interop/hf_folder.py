"""Reading and writing Hugging Face model folders (config.json, safetensors, tokenizer files).

Writes go to a temporary sibling folder renamed into place at the end, so an interrupted
export never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from nanotron_models.config import DTYPES

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # transformers >= 4.50 saves a chat template here
)


class HFFolderError(ValueError):
    """A Hugging Face folder we cannot read (no family of ours, no weights) or write."""


def read_hf_config(folder: Path) -> dict:
    """config.json of a model folder of one of our families (Llama, Qwen2, SmolLM3); a clear
    error for anything else."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise HFFolderError(f"{folder}: no such Hugging Face model folder")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFFolderError(
            f"{path}: missing; {folder} is not a Hugging Face model folder"
        ) from None
    except ValueError:
        raise HFFolderError(f"{path}: not valid JSON") from None
    if not isinstance(config, dict):
        raise HFFolderError(f"{path}: not a JSON object")
    from nanotron_models import ModelConfigError
    from nanotron_models.families import family_of_hf

    try:
        family_of_hf(config)
    except ModelConfigError as exc:
        raise HFFolderError(f"{path}: {exc}; only these can be imported") from None
    return config


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards listed by model.safetensors.index.json."""
    from safetensors.torch import load_file

    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError):
            raise HFFolderError(f"{index}: not a safetensors index (no weight_map)") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        raise HFFolderError(
            f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors "
            "weights are read; re-save the model with safe_serialization=True)"
        )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except FileNotFoundError:
            raise HFFolderError(f"{f}: missing weight file") from None
        except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
            raise HFFolderError(f"{f}: unreadable safetensors file ({exc})") from None
    return out


def hf_dtype_name(config: dict) -> str:
    """The weights' dtype recorded in config.json (`dtype` in v5, `torch_dtype` before)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return name if name in DTYPES else "float32"


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files present in folder `src` to `dst`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def check_writable(out: Path, overwrite: bool) -> None:
    """Refuse to replace an existing, non-empty `out` unless asked to."""
    if out.exists() and not overwrite and any(out.iterdir() if out.is_dir() else [out]):
        raise HFFolderError(f"{out}: already exists (pass --overwrite to replace it)")


def write_folder_atomically(out: Path, fill: Callable[[Path], None], overwrite: bool) -> Path:
    """Call `fill(tmp)` on a fresh temporary folder next to `out`, then rename it to `out`."""
    check_writable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fill(tmp)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
