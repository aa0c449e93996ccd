"""`parallelism: auto` (or `--auto`): train with the planner's best fitting layout.

The planner (enumerate.py) lists every layout of the world size that the config checks accept
(dp x tp x pp x cp, ep, ZeRO stage, micro-batch size keeping the config's global batch,
recompute, pipeline engine), predicts each on this machine's device and ranks those that fit by
tokens/s per device; the run takes the first. Every rank computes the same choice from the
same inputs (the config, the world size, the ranks per node and the device's constants: the
GPU's model and total memory, or a CPU host's MemTotal, never a figure that moves between
reads such as free memory), so no rank has to tell the others. Nothing fitting is a
ConfigError (one line, exit status 2), the same on every rank.
"""

from __future__ import annotations

import dataclasses
import os

from nanotron_train.config.errors import ConfigError
from nanotron_train.plan.devices import DEVICES, GIB, Device
from nanotron_train.plan.enumerate import Plan, plan

MEMINFO = "/proc/meminfo"
SHOWN_ENV = "NANOTRON_AUTO_LAYOUT_SHOWN"  # set by nanotron_train.launch once it printed the block


def local_device(gpus_per_node: int) -> Device:
    """The planner's device for this machine: the table's row of the GPU model (its memory as
    the GPU reports it), h100's constants for a GPU the table does not know, or the `cpu` row
    with the host's MemTotal shared by the node's ranks."""
    import torch

    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        known = next((k for k in DEVICES if k != "cpu" and k in props.name.lower()), None)
        row = DEVICES[known or "h100"]
        source = row.source if known else f"{props.name}: not in the table, h100's constants"
        return dataclasses.replace(row, memory_bytes=props.total_memory, source=source)
    total = _mem_total()
    row = DEVICES["cpu"]
    return dataclasses.replace(row, memory_bytes=total // gpus_per_node) if total else row


def _mem_total() -> int:
    try:
        with open(MEMINFO) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return 0


def describe(p: Plan) -> str:
    o = p.overrides
    engine = f" {o['parallelism.pp_engine']}" if o["parallelism.pp"] > 1 else ""
    return (
        f"dp={o['parallelism.dp']} tp={o['parallelism.tp']} pp={o['parallelism.pp']}{engine} "
        f"cp={o['parallelism.context_parallel_size']} "
        f"ep={o['parallelism.expert_parallel_size']} zero={o['optimizer.zero_stage']} "
        f"micro_batch_size={o['tokens.micro_batch_size']} "
        f"batch_accumulation={o['tokens.batch_accumulation_per_replica']} "
        f"recompute={'full' if o['parallelism.recompute_layer'] else 'off'}"
    )


def _size(n: float) -> str:
    return f"{n / GIB:.3g} GiB" if n >= GIB else f"{n / 2**20:.3g} MiB"


def _prediction(p: Plan) -> str:
    t = p.time
    largest, size = p.memory.largest_part()
    return (
        f"peak {_size(p.memory.total)} on the worst rank (largest part: {largest} "
        f"{_size(size)}); "
        f"step {t.total:.4g} s = compute {t.compute:.3g} + exposed communication "
        f"{t.exposed_comm:.3g} + pipeline idle {t.idle:.3g} + optimizer {t.optimizer:.3g}; "
        f"{p.tokens_per_s_per_device:.4g} tokens/s per device, MFU {p.mfu:.3f}"
    )


def report(best: Plan, runner_up: Plan | None, fit: int, listed: int, world: int, device) -> str:
    """The block a run prints: what it chose, the prediction, the runner-up."""
    lines = [
        f"parallelism: auto: {world} rank{'s' if world > 1 else ''} on {device.name} "
        f"({_size(device.memory_bytes)} per rank; {device.source}): {fit} of {listed} layouts "
        "fit; chose the fastest predicted",
        f"  chosen:    {describe(best)}",
        f"  predicted: {_prediction(best)}",
    ]
    if runner_up is not None:
        slower = runner_up.time.total / best.time.total
        lines.append(
            f"  runner-up: {describe(runner_up)}: step {runner_up.time.total:.4g} s "
            f"({slower:.3f}x), peak {_size(runner_up.memory.total)}"
        )
    return "\n".join(lines)


def choose(cfg, world: int, gpus_per_node: int, device: Device) -> tuple[list[Plan], str]:
    """(the ranked layouts that fit, the block to print); ConfigError when none fits."""
    base = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, auto=False))
    plans, refused = plan(base, device, world, gpus_per_node)
    fits = [p for p in plans if p.fits]
    if not plans:
        raise ConfigError(
            "parallelism", f"auto: no layout of {world} ranks passes the config checks "
            f"({refused} refused; the first check a layout fails says why: give one "
            "explicitly)",
        )  # fmt: skip
    if not fits:
        least = min(plans, key=lambda p: p.memory.total)
        raise ConfigError(
            "parallelism",
            f"auto: none of the {len(plans)} layouts of {world} ranks fits {device.name} "
            f"({device.memory_bytes / GIB:.1f} GiB per rank); the smallest ({describe(least)}) "
            f"{least.overflow}: add ranks, shorten tokens.sequence_length or use a smaller model",
        )
    block = report(fits[0], fits[1] if len(fits) > 1 else None, len(fits), len(plans), world,
                   device)  # fmt: skip
    return fits, block


def resolve(cfg, world: int, gpus_per_node: int | None = None, source: str = "<config>"):
    """(the config with the chosen layout and parallelism.auto false, the block to print);
    the config itself and None when it does not ask for auto."""
    if not cfg.parallelism.auto:
        return cfg, None
    gpus = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    try:
        fits, block = choose(cfg, world, gpus, local_device(gpus))
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.detail, source) from None
    return fits[0].cfg, block
