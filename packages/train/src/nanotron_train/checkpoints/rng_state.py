"""Each rank's RNG states (Python's `random`, NumPy, torch CPU and CUDA), stored without pickle.

`rng/rank{N}.safetensors` holds the states as tensors (torch's and CUDA's byte states, the
Mersenne Twister keys of Python and NumPy as int64) and the few scalars beside them (Python's
cached gaussian, NumPy's position and cached gaussian) as JSON in the header. Loading it runs
no code whatever the file holds, and anything malformed is one line naming the file.
Checkpoints of format 1 hold `rng/rank{N}.pt` (a torch.save pickle): those still load, through
torch.load(weights_only=True), with any failure turned into the same kind of one line.
"""

from __future__ import annotations

import io
import math
import random
import warnings
from pathlib import Path

import numpy as np
import torch

from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.files import read_verified
from nanotron_train.checkpoints.layout import legacy_rng_file, rng_file
from nanotron_train.checkpoints.safetensors_io import load_tensors

MT_WORDS = 624  # the Mersenne Twister's state: 624 32-bit words (+ a position)


def rng_tensors() -> tuple[dict[str, torch.Tensor], dict]:
    """This process's RNG states: (tensors, JSON scalars) for safetensors_io.save_tensors."""
    py_version, py_words, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {
        "python": torch.tensor(py_words, dtype=torch.int64),
        "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    meta = {
        "python_version": py_version,
        "python_gauss_next": gauss_next,
        "numpy_kind": kind,
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_cached_gaussian": float(cached),
    }
    return tensors, meta


def load_rng(folder: Path, rank: int, records: dict[str, dict]) -> None:
    """Restore this rank's RNG states from whichever format the checkpoint holds."""
    rel = rng_file(rank)
    if rel in records or legacy_rng_file(rank) not in records:
        path = folder / rel
        tensors, meta = load_tensors(path, records.get(rel))
        _apply(path, lambda: _from_tensors(tensors, meta))
        return
    rel = legacy_rng_file(rank)
    path = folder / rel
    raw = read_verified(path, records[rel])
    try:
        with warnings.catch_warnings():  # a crafted file's protocol warning: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(io.BytesIO(bytes(raw)), weights_only=True)
    except Exception as exc:  # any unpickling failure of a damaged or crafted file
        raise CheckpointError(f"{path}: not a readable RNG state ({_first_line(exc)})") from None
    _apply(path, lambda: _from_legacy(state))


def _apply(path: Path, restore) -> None:
    try:
        restore()
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a valid RNG state ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _words(t: torch.Tensor, name: str, n: int) -> list[int]:
    if t.dtype != torch.int64 or tuple(t.shape) != (n,):
        raise ValueError(f"{name}: expected int64 of shape ({n},), got {t.dtype} {list(t.shape)}")
    words = t.tolist()
    if not all(0 <= w < 2**32 for w in words):
        raise ValueError(f"{name}: words must be in [0, 2**32)")
    return words


def _scalar(meta: dict, key: str, kind: type) -> float | int:
    value = meta[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{key}: expected {kind.__name__}, got {value!r:.40}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key}: not finite")
    return value


def _from_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    words = _words(tensors["python"], "python", MT_WORDS + 1)
    gauss = meta["python_gauss_next"]
    if gauss is not None:
        gauss = float(_scalar(meta, "python_gauss_next", float))
    random.setstate((_scalar(meta, "python_version", int), tuple(words), gauss))
    keys = np.asarray(_words(tensors["numpy"], "numpy", MT_WORDS), dtype=np.uint32)
    np.random.set_state((
        str(meta["numpy_kind"]),
        keys,
        _scalar(meta, "numpy_pos", int),
        _scalar(meta, "numpy_has_gauss", int),
        float(_scalar(meta, "numpy_cached_gaussian", float)),
    ))  # fmt: skip
    _set_torch(tensors["torch"], tensors.get("cuda"))


def _from_legacy(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    _set_torch(state["torch"], state.get("cuda"))


def _set_torch(cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        raise TypeError("torch: expected a uint8 tensor")
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list | tuple) else x


def reseed(seed: int) -> None:
    """A different world: fresh deterministic streams from (seed, step)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
