"""A small safetensors writer/reader (the format: u64 header length, JSON header, raw bytes).

Written by hand so shards stream to disk tensor by tensor with the checksum computed on the
way (files.write_durable), and load as zero-copy views of one verified buffer. The files are
ordinary safetensors: the `safetensors` library reads them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.files import FileRecord, read_verified, write_durable

DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
FROM_NAME = {v: k for k, v in DTYPES.items()}


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict, root: Path
) -> FileRecord:
    """Write `tensors` with `metadata` (JSON-able, stored as one string under "nanotron")."""
    header: dict = {"__metadata__": {"nanotron": json.dumps(metadata, sort_keys=True)}}
    offset = 0
    raws = []
    for name, t in tensors.items():
        raw = _raw(t)
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        offset += raw.nbytes
        raws.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data start to 8 bytes
    return write_durable(path, [struct.pack("<Q", len(text)) + text, *raws], root)


def _parse_header(path: Path, buf: bytes | bytearray, size: int) -> tuple[dict, int]:
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if 8 + n > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file (header of {n} bytes, file of {size})"
        )
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except ValueError:
        raise CheckpointError(f"{path}: not a safetensors file (unreadable header)") from None
    return header, 8 + n


def read_header(path: Path) -> tuple[dict, dict]:
    """(tensor entries, our metadata) from the header only: cheap, used to index a checkpoint."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = path.stat().st_size
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            data = head + f.read(min(n, max(size - 8, 0)))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing file") from None
    header, _ = _parse_header(path, data, size)
    return _split(path, header, size)


def _split(path: Path, header: dict, size: int, data_start: int | None = None) -> tuple[dict, dict]:
    meta = header.pop("__metadata__", {}) or {}
    end = max((e["data_offsets"][1] for e in header.values()), default=0)
    start = data_start if data_start is not None else size - end
    if data_start is not None and start + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file (data ends at {start + end}, file has {size})"
        )
    try:
        ours = json.loads(meta.get("nanotron", "{}"))
    except ValueError:
        raise CheckpointError(f"{path}: unreadable nanotron metadata in the header") from None
    return header, ours


def load_tensors(path: Path, record: dict | None) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of a verified file (views into one buffer) and our metadata."""
    buf = read_verified(path, record)
    header, start = _parse_header(path, buf, len(buf))
    entries, ours = _split(path, header, len(buf), start)
    out = {}
    for name, e in entries.items():
        dtype = FROM_NAME.get(e["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
        lo, hi = e["data_offsets"]
        shape = tuple(e["shape"])
        count = (hi - lo) // torch.empty((), dtype=dtype).element_size()
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=start + lo).view(
                shape
            )
    return out, ours
