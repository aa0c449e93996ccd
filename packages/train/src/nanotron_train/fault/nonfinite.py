"""Non-finite loss or gradient norm: `stop`, `skip` the optimizer step, or `rollback`.

The check reads the global gradient norm and the global mean loss, which the step already
brings to the host (the norm for clipping, the loss for logging), and which are the same on
every rank after their all-reduces: every rank takes the same decision with no extra
synchronisation. Only on a failure under `stop` does it look further (which parameter), since
the run ends anyway.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist

from nanotron_train.fault.errors import NonFiniteStop

Action = Literal["ok", "skip", "stop", "rollback"]


class NonFiniteGuard:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.skipped = 0  # optimizer steps skipped over the run (this launch)

    def check(self, loss: float, grad_norm: float | None) -> Action:
        values = [loss] + ([grad_norm] if grad_norm is not None else [])
        if all(math.isfinite(v) for v in values):
            return "ok"
        if self.policy == "skip":
            self.skipped += 1
        return self.policy  # type: ignore[return-value]


def first_nonfinite_gradient(named_params, pc, grads_of=None) -> str:
    """`name (rank R)` of the first parameter, in model order, whose gradient is non-finite.
    `grads_of(param)`: the reduced gradient pieces this rank holds (ZeRO-2/3: its chunks);
    default `param.main_grad`."""
    mine = None
    for name, p in named_params:
        if grads_of is not None:
            grads = grads_of(p)
        else:
            grads = [g] if (g := getattr(p, "main_grad", None)) is not None else []
        if any(not bool(torch.isfinite(g).all()) for g in grads):
            mine = name
            break
    found: list[str | None] = [None] * pc.world_size
    dist.all_gather_object(found, mine, group=pc.world_group)
    # Ranks are pp-major, so the lowest rank holding one is the earliest stage.
    for rank, name in enumerate(found):
        if name is not None:
            return f"{name} (rank {rank})"
    return "none (the loss itself is non-finite)"


def stop(
    step: int, loss: float, grad_norm: float | None, named_params, pc, grads_of=None
) -> NonFiniteStop:
    where = first_nonfinite_gradient(named_params, pc, grads_of)
    return NonFiniteStop(
        f"non-finite values at step {step}: lm_loss={loss}, grad_norm={grad_norm}; first "
        f"parameter with a non-finite gradient: {where} (fault_tolerance.nonfinite_policy: stop)",
        step,
    )
