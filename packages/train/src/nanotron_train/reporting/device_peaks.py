"""What the device can do and what the run used of it: the peak TFLOP/s table (for MFU) and
the peak memory a step record shows."""

from __future__ import annotations

import os
import resource

import torch

# Dense bf16/fp16 tensor-core peaks (TFLOP/s) by device-name fragment. Unknown devices and
# other dtypes give None (no MFU) rather than a guess; NANOTRON_PEAK_TFLOPS overrides.
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def device_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    env = os.environ.get("NANOTRON_PEAK_TFLOPS")
    if env:
        return float(env)
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peak in _PEAK_BF16_TFLOPS.items():
        if fragment in name:
            return peak
    return None


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
