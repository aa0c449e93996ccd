"""Every layout of a config's model and global batch on a world of N ranks, each predicted.

A layout is dp x tp x pp x cp = N (ep a divisor of dp, MoE models only), a micro-batch size
dividing the replica's batch (global batch / dp sequences; m = the rest), a ZeRO stage 0-3,
recompute off or full (`recompute_layer`; the project has no selective recompute), every pipeline engine of
the registry at pp > 1 (interleaved-1f1b with 2 virtual stages), sequence parallel at tp > 1.
Each is the config with those keys changed and is kept only when the config checks accept it
(the same checks a run meets), so a planned layout never fails at start.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from nanotron_models.families import family_of
from nanotron_parallel.pipeline.engines import ENGINES
from nanotron_train.config.checks import validate
from nanotron_train.config.errors import ConfigError
from nanotron_train.plan.devices import Device
from nanotron_train.plan.memory import MemoryEstimate, estimate
from nanotron_train.plan.step_time import StepTime, step_time

# The lowest estimate / measured peak ratio tests/train/test_plan_memory.py allows: a layout
# fits only if it would still fit were the estimate that much low.
LOWEST_RATIO = 0.95


@dataclass
class Plan:
    overrides: dict[str, object]
    memory: MemoryEstimate
    time: StepTime
    tokens_per_s_per_device: float
    mfu: float
    fits: bool
    overflow: str = ""
    cfg: object = field(default=None, repr=False)

    def as_dict(self) -> dict:
        t = self.time
        return {
            "overrides": self.overrides,
            "fits": self.fits,
            "overflow": self.overflow,
            "memory_bytes": self.memory.as_dict(),
            "step_time_s": {
                "total": t.total, "compute": t.compute, "exposed_comm": t.exposed_comm,
                "pipeline_idle": t.idle, "optimizer": t.optimizer,
            },
            "comm_bytes_per_step": t.comm_bytes,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu,
        }  # fmt: skip


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(cfg, world: int) -> Iterator[dict[str, object]]:
    par, tok = cfg.parallelism, cfg.tokens
    batch = par.dp * tok.micro_batch_size * tok.batch_accumulation_per_replica
    moe = getattr(cfg.model.model_config, "moe_config", None) is not None
    for tp, pp, cp in itertools.product(divisors(world), repeat=3):
        if world % (tp * pp * cp) or batch % (world // (tp * pp * cp)):
            continue
        dp = world // (tp * pp * cp)
        engines = sorted(ENGINES) if pp > 1 else [par.pp_engine]
        for mbs, ep, zero, recompute, eng in itertools.product(
            divisors(batch // dp), divisors(dp) if moe else [1], range(4), (False, True), engines
        ):
            yield {
                "parallelism.dp": dp, "parallelism.tp": tp, "parallelism.pp": pp,
                "parallelism.context_parallel_size": cp, "parallelism.expert_parallel_size": ep,
                "parallelism.pp_engine": eng,
                "parallelism.pp_virtual_stages": 2 if ENGINES[eng].uses_virtual_stages else 1,
                "parallelism.tp_mode": "REDUCE_SCATTER" if tp > 1 else "ALL_REDUCE",
                "parallelism.recompute_layer": recompute,
                "tokens.micro_batch_size": mbs,
                "tokens.batch_accumulation_per_replica": batch // dp // mbs,
                "optimizer.zero_stage": zero,
            }  # fmt: skip


def with_overrides(cfg, overrides: dict[str, object]):
    sections: dict[str, dict[str, object]] = {}
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        sections.setdefault(section, {})[key] = value
    changes = {s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()}
    return dataclasses.replace(cfg, **changes)


def _params_rank(cfg) -> int:
    mc, par = cfg.model.model_config, cfg.parallelism
    return family_of(mc).num_parameters(mc) // (par.tp * par.pp)


def predict(cfg, device: Device, world: int, gpus_per_node: int) -> Plan:
    """One layout's memory, step time, tokens/s per device and MFU."""
    mem = estimate(cfg, host=device.name == "cpu")
    t = step_time(cfg, device, gpus_per_node, _params_rank(cfg))
    tok, mc = cfg.tokens, cfg.model.model_config
    batch_tokens = cfg.parallelism.dp * tok.micro_batch_size * tok.batch_accumulation_per_replica
    batch_tokens *= tok.sequence_length
    per_device = batch_tokens / t.total / world
    flops = family_of(mc).training_flops_per_token(mc, tok.sequence_length)
    mfu = per_device * flops / device.peak(cfg.model.dtype)
    have = device.memory_bytes - device.reserved_bytes
    fits = mem.total / LOWEST_RATIO <= have
    overflow = ""
    if not fits:
        biggest = mem.largest_part()
        overflow = (
            f"needs {mem.total / 2**30:.1f} GiB (/ {LOWEST_RATIO} margin) of {have / 2**30:.1f} GiB "
            f"(largest part: {biggest[0]} {biggest[1] / 2**30:.1f} GiB)"
        )
    return Plan({}, mem, t, per_device, mfu, fits, overflow, cfg)


def plan(cfg, device: Device, world: int, gpus_per_node: int) -> tuple[list[Plan], int]:
    """(every valid layout predicted, fastest first among those that fit; how many candidates
    the config checks refused)."""
    plans, refused = [], 0
    for overrides in _layouts(cfg, world):
        candidate = with_overrides(cfg, overrides)
        try:
            validate(candidate, "plan", world)
        except ConfigError:
            refused += 1
            continue
        p = predict(candidate, device, world, gpus_per_node)
        p.overrides = overrides
        plans.append(p)
    plans.sort(key=lambda p: (not p.fits, -p.tokens_per_s_per_device, p.memory.total))
    return plans, refused
