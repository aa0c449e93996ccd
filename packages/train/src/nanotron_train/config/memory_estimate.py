"""The memory a config needs per rank, checked against the machine before anything is allocated.

A sequence length or micro-batch too large for the machine otherwise grows the process for
minutes until the kernel or the allocator kills it. `check_memory` (the trainer's first step,
on every rank) compares `estimate(cfg)` with what the device has free: on CUDA,
torch.cuda.mem_get_info of the rank's device; on the CPU, /proc/meminfo's MemAvailable shared
by the ranks on the host. When the estimate is larger the run stops in one line with both
figures; `general.ignore_memory_check: true` (named after Nanotron's `ignore_sanity_checks`
beside it) skips the check for a machine where the estimate is known to be pessimistic.

The estimate is the planner's memory model (nanotron_train/plan/memory.py, which says what it
counts): one model for both, which aims to err high (tests/train/test_plan_memory.py asserts
its tensor bytes within 0.95-1.15x of the allocator's measured peak in small runs of every
layout kind); its total adds the allocator's fragmentation on this device and a runtime
reserve.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from nanotron_train.plan.memory import GIB, MemoryEstimate, estimate

__all__ = ["GIB", "MemoryCheckError", "MemoryEstimate", "check_memory", "estimate", "memory_error"]
MEMINFO = "/proc/meminfo"


class MemoryCheckError(ValueError):
    """The config needs more memory than the machine has; the message gives both figures."""


def available_bytes(device: torch.device, world_size: int) -> tuple[int, str]:
    """(bytes this rank may use, where the figure comes from)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    try:
        with open(MEMINFO) as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 2**63, "unknown"  # no figure to check against: not refused
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    share = f", shared by {ranks} ranks on this host" if ranks > 1 else ""
    return kib * 1024 // ranks, f"MemAvailable {kib * 1024 / GIB:.1f} GiB{share}"


def memory_error(cfg, device: torch.device, world_size: int) -> str | None:
    est = estimate(cfg, host=device.type != "cuda")
    have, where = available_bytes(device, world_size)
    if est.total <= have:
        return None
    tok = cfg.tokens
    return (
        f"not enough memory: this config needs about {est.total / GIB:.1f} GiB per rank "
        f"({est.describe()}; tokens.sequence_length={tok.sequence_length} x "
        f"tokens.micro_batch_size={tok.micro_batch_size}, {est.in_flight} micro-batches in "
        f"flight) but this rank has {have / GIB:.1f} GiB ({where}): lower them, add "
        "parallelism or parallelism.recompute_layer, or set general.ignore_memory_check: true"
    )


def check_memory(cfg, pc) -> None:
    """Collective: every rank raises the same line when one rank's estimate does not fit."""
    if cfg.general.ignore_memory_check:
        return
    error = memory_error(cfg, pc.device, pc.world_size)
    if pc.world_size > 1:
        errors: list[str | None] = [None] * pc.world_size
        dist.all_gather_object(errors, error, group=pc.world_group)
        error = next((e for e in errors if e), None)
    if error:
        raise MemoryCheckError(error)
