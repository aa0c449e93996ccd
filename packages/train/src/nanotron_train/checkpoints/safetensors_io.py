"""A small safetensors writer/reader (the format: u64 header length, JSON header, raw bytes).

Written by hand rather than with the `safetensors` library, for speed on both sides:
  * save streams shards to disk tensor by tensor with the sha256 computed on the way
    (files.write_durable), where `safetensors.torch.save_file` would first serialise the whole
    shard to memory and a separate pass would hash it;
  * load reads every tensor's bytes exactly once, hashing them as they arrive, straight into
    the tensor that keeps them (the live parameter or Adam moment when the caller offers one,
    else a fresh tensor). The library's loaders either copy out of an mmap of the file (a second
    read that the checksum did not see, into freshly faulted memory) or parse a `bytes` object
    (a full extra copy), and do not expose the data offsets needed to read into given tensors.
The files are ordinary safetensors: the `safetensors` library reads them (tests check it).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.files import CHUNK, FileRecord, VerifiedReader, write_durable

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


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def _target(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, into: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The caller's tensor for `name` when the bytes can land in it as they are, else a new one."""
    t = into.get(name)
    if (
        t is not None
        and t.dtype == dtype
        and tuple(t.shape) == shape
        and t.device.type == "cpu"
        and t.is_contiguous()
    ):
        return t.detach()
    return torch.empty(shape, dtype=dtype)  # uninitialised: the read overwrites every byte


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def load_tensors(
    path: Path, record: dict | None, into: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of a verified file and our metadata.

    `into` offers destination tensors by name: a CPU tensor with the stored dtype and shape gets
    the bytes read straight into it (no staging buffer, no copy) and is returned.
    If the file then fails its checksum the error is raised and those tensors hold unverified
    bytes: a caller offering its live state must treat the error as fatal (resume does).
    """
    into = into or {}
    with VerifiedReader(path, record) as reader:
        size = reader.size
        if size < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        head = bytearray(8)
        reader.read_into(memoryview(head))
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file (header of {n} bytes, file of {size})"
            )
        text = bytearray(n)
        reader.read_into(memoryview(text))
        header, start = _parse_header(path, head + text, size)
        entries, ours = _split(path, header, size, start)
        out: dict[str, torch.Tensor] = {}
        pos = 0  # offset in the data section
        for name, e in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = FROM_NAME.get(e["dtype"])
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
            lo, hi = e["data_offsets"]
            shape = tuple(e["shape"])
            if lo < pos or hi - lo != _nbytes(shape, dtype):
                raise CheckpointError(
                    f"{path}: tensor {name} has bad data offsets {[lo, hi]} for shape {list(shape)}"
                )
            if lo > pos:  # bytes between tensors: read (the checksum covers them) and drop
                reader.read_into(memoryview(bytearray(lo - pos)))
            out[name] = _target(name, shape, dtype, into)
            if hi > lo:
                reader.read_into(_bytes_of(out[name]))
            pos = hi
        rest = size - reader.pos
        while rest > 0:  # trailing bytes after the last tensor: checked, then dropped
            k = min(rest, CHUNK)
            reader.read_into(memoryview(bytearray(k)))
            rest -= k
        reader.verify()
    return out, ours
