"""Device constants the planner's time and memory models read: a table of known devices, or a
YAML file of the same fields (`--device FILE.yaml`).

Vendor-sheet figures (NVIDIA's datasheets: H100 SXM5, H200 SXM, A100 SXM4 80GB, HGX B200):
`peak_flops` (dense bf16/fp16 tensor cores, no sparsity), `peak_flops_fp32` (dense TF32),
`memory_bytes` (HBM), `memory_bandwidth`, `intra_node_bandwidth` (NVLink, per GPU and
direction: half the bidirectional figure) and `inter_node_bandwidth` (one 400 Gb/s NDR port
per GPU, 200 Gb/s HDR for A100: 50 and 25 GB/s). Not from a sheet, assumptions until
`--calibrate` fits them from a run: `achievable` (the share of the peak a training step's
kernels reach), `link_efficiency` (the share of a link's bandwidth a collective reaches),
`reserved_bytes` (the CUDA context, NCCL's buffers and the allocator's reserve). The `cpu`
row is a placeholder to be calibrated, not a measurement of any machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

GB, GIB, TERA = 10**9, 2**30, 10**12


class DeviceError(ValueError):
    """A device name or file the planner cannot use; the message is one line."""


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # FLOP/s, dense bf16/fp16
    peak_flops_fp32: float  # FLOP/s, dense fp32 (TF32 tensor cores on the GPUs)
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per device and direction
    inter_node_bandwidth: float  # bytes/s per device and direction
    achievable: float = 0.45
    link_efficiency: float = 0.75
    reserved_bytes: int = 2 * GIB
    source: str = "vendor sheet; achievable, link_efficiency and reserved_bytes assumed"

    def peak(self, dtype: str) -> float:
        return self.peak_flops_fp32 if dtype == "float32" else self.peak_flops


DEVICES: dict[str, Device] = {
    "h100": Device("h100", 989e12, 494.7e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB),
    "h200": Device("h200", 989e12, 494.7e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB),
    "a100": Device("a100", 312e12, 156e12, 80 * GB, 2.039e12, 300 * GB, 25 * GB),
    "b200": Device("b200", 2250e12, 1100e12, 180 * GB, 8e12, 900 * GB, 50 * GB),
    "cpu": Device(
        "cpu",
        50e9,
        50e9,
        16 * GIB,
        10 * GB,
        5 * GB,
        1 * GB,
        achievable=1.0,
        link_efficiency=1.0,
        reserved_bytes=0,
        source="placeholder: calibrate with --calibrate",
    ),  # fmt: skip
}
FIELDS = {f.name: f.type for f in dataclasses.fields(Device)}


def load_device(spec: str) -> Device:
    """A known device by name, or a YAML file holding every field without a default."""
    if spec.lower() in DEVICES:
        return DEVICES[spec.lower()]
    path = Path(spec)
    if not path.is_file():
        raise DeviceError(f"--device: {spec!r} is neither one of {sorted(DEVICES)} nor a file")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DeviceError(f"--device {path}: not readable YAML ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise DeviceError(f"--device {path}: expected a mapping of {', '.join(FIELDS)}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise DeviceError(
            f"--device {path}: unknown key {unknown[0]!r} (known: {', '.join(FIELDS)})"
        )
    data.setdefault("name", path.stem)
    data.setdefault("source", str(path))
    try:
        device = Device(**data)
    except TypeError as exc:
        raise DeviceError(f"--device {path}: {exc}") from None
    for key, value in dataclasses.asdict(device).items():
        if key not in ("name", "source") and not (
            isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
        ):
            raise DeviceError(f"--device {path}: {key} must be a number >= 0, got {value!r}")
    return device
