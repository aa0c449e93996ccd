"""CPU, memory and GPU readings of this process and machine, cheap enough for every interval.

CPU time and RSS come from the standard library and /proc (no psutil dependency: two numbers
do not need it). GPU utilisation, memory and power come from NVML through `nvidia-ml-py`
(`import pynvml`), used only when it is installed and the run is on CUDA; any NVML error makes
those readings absent (None), never a failure.
"""

from __future__ import annotations

import os
import time

import torch


class CpuMeter:
    """This process's CPU use since the previous reading, in % of one core (top's convention:
    a process busy on two cores reads 200)."""

    def __init__(self) -> None:
        self._last = self._now()

    @staticmethod
    def _now() -> tuple[float, float]:
        t = os.times()
        return t.user + t.system, time.monotonic()

    def percent(self) -> float | None:
        cpu, wall = self._now()
        (cpu0, wall0), self._last = self._last, (cpu, wall)
        return max(0.0, 100.0 * (cpu - cpu0) / (wall - wall0)) if wall > wall0 else None


class SystemCpuMeter:
    """The machine's CPU utilisation (all cores, 0..100) since the previous reading, from
    /proc/stat; None where there is no /proc."""

    def __init__(self) -> None:
        self._last = self._read()
        self._pct: float | None = None

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, sum(fields)

    def percent(self) -> float | None:
        """Since the previous reading; the previous value when no clock tick (10 ms) passed."""
        now, last = self._read(), self._last
        if now is None or last is None:
            return None
        if now[1] > last[1]:
            self._pct = 100.0 * (now[0] - last[0]) / (now[1] - last[1])
            self._last = now
        return self._pct


def rss_bytes() -> int | None:
    """This process's resident set size now (/proc/self/statm), None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Nvml:
    """One GPU's NVML handle; `open` returns None without pynvml, CUDA or a working driver."""

    def __init__(self, pynvml, handle) -> None:
        self._nvml, self._handle = pynvml, handle

    @classmethod
    def open(cls, device: torch.device) -> Nvml | None:
        if device.type != "cuda":
            return None
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            # NVML numbers the GPUs of the machine; CUDA_VISIBLE_DEVICES renumbers CUDA's.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                ids = [v.strip() for v in visible.split(",") if v.strip()]
                if index < len(ids) and ids[index].isdigit():
                    index = int(ids[index])
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
        except Exception:  # noqa: BLE001  (pynvml.NVMLError and driver trouble alike)
            return None

    def _read(self, fn):
        try:
            return fn(self._handle)
        except Exception:  # noqa: BLE001
            return None

    def utilization_pct(self) -> float | None:
        rates = self._read(self._nvml.nvmlDeviceGetUtilizationRates)
        return None if rates is None else float(rates.gpu)

    def memory_used_bytes(self) -> int | None:
        info = self._read(self._nvml.nvmlDeviceGetMemoryInfo)
        return None if info is None else int(info.used)

    def power_w(self) -> float | None:
        mw = self._read(self._nvml.nvmlDeviceGetPowerUsage)
        return None if mw is None else mw / 1000.0


class SystemMetrics:
    """The `system/*` values of rank 0's metrics record (absent when unknown)."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = SystemCpuMeter()
        self.nvml = Nvml.open(device)

    def values(self) -> dict[str, float]:
        out = {"system/cpu_util_pct": self.cpu.percent(), "system/rss_bytes": rss_bytes()}
        if self.nvml is not None:
            out["system/gpu_util_pct"] = self.nvml.utilization_pct()
            out["system/gpu_mem_bytes"] = self.nvml.memory_used_bytes()
            out["system/gpu_power_w"] = self.nvml.power_w()
        return {k: v for k, v in out.items() if v is not None}
