"""AdamW on the CPU in cache-sized blocks: torch's per-tensor AdamW, bitwise, with less memory
traffic.

AdamW is a handful of elementwise passes (decay, two moment updates, the denominator, the
update) over four tensors of the parameter's size. torch's `foreach` implementation runs each
pass over every parameter before the next one, and its per-tensor loop each pass over a whole
parameter: with tens of MB per tensor, every pass streams from DRAM. Here the same operations,
in the same order, run on one block of each tensor at a time, small enough that the four
blocks stay in the core's cache between the passes. Elementwise operations do not depend on
where a block starts, so the results are bitwise those of `torch.optim.AdamW(foreach=False)`
(and of foreach, which torch keeps bitwise equal to it); the optimizer state lives in the
torch optimizer as usual (same keys, same checkpoints). GPUs keep torch's foreach kernels.

A block holds up to BLOCK elements of one or several parameters (a large one is cut into
blocks; small ones, such as norm weights, share one), and each pass over a block is one
`torch._foreach_*` call over its slices: a model with many small parameters pays a few calls
per block instead of five Python-level calls per parameter. The blocks' views are made once
and reused while the parameters, gradients and moments stay the same tensors. The step's
scalars (decay factor, bias correction, beta2, eps) are 0-d fp32 tensors: an op given a
Python float first copies it into such a tensor, one scalar copy per call; the value is the
same fp32 number either way. The per-parameter step counters are 0-d tensors too (torch's
state, saved in checkpoints); their values are kept on the host from step to step instead of
read back with one `.item()` per parameter per step.
"""

from __future__ import annotations

import operator

import torch

# Elements per block: 4 tensors x 256k fp32 = 4 MiB, cache-resident between the passes, and
# large enough that each op still splits over the intra-op threads. Measured on the 2-core
# machine (33.6M parameters, CPU time per step): 64k-512k blocks all 0.69-0.71 of foreach's.
BLOCK = 1 << 18


def _state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """The state torch's AdamW would create on the first step (same keys, dtypes, devices)."""
    state = opt.state[p]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _scalar(value: float) -> torch.Tensor:
    return torch.scalar_tensor(value, dtype=torch.float32)  # one op, no copy


# The constants (1, beta2, eps) as 0-d tensors, made once per value: only ever read.
_CONSTANTS: dict[float, torch.Tensor] = {}


def _constant(value: float) -> torch.Tensor:
    tensor = _CONSTANTS.get(value)
    if tensor is None:
        tensor = _CONSTANTS[value] = _scalar(value)
    return tensor


# fp32 counts every integer up to here exactly; past it `+ 1` may round, so read the tensors.
_EXACT_COUNTS = float(1 << 24)


def _advance_steps(opt, group_index: int, step_tensors: list[torch.Tensor]) -> list[float]:
    """Add 1 to each parameter's step counter (0-d fp32, as torch's AdamW keeps it) and return
    the new values. They are read on the host (one `.item()` each) only when they may have
    changed since the last step other than by our own `+ 1`: a different tensor (a loaded
    checkpoint makes new ones) or another in-place write (its version counter moved)."""
    torch._foreach_add_(step_tensors, [_constant(1.0)] * len(step_tensors))
    cache = opt.__dict__.setdefault("_nanotron_steps", {})
    hit = cache.get(group_index)
    versions = [t._version for t in step_tensors]
    if (
        hit is not None
        and len(hit[0]) == len(step_tensors)
        and all(map(operator.is_, hit[0], step_tensors))  # (C loops: no Python call each)
        and versions == [v + 1 for v in hit[1]]
        and max(hit[2]) < _EXACT_COUNTS
    ):
        steps = [s + 1.0 for s in hit[2]]
    else:
        steps = [t.item() for t in step_tensors]  # host tensors: no device sync
    cache[group_index] = (list(step_tensors), versions, steps)
    return steps


Block = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def _blocks(params: list[torch.Tensor], states: list[dict], block: int) -> list[Block]:
    """(parameters, gradients, exp_avg, exp_avg_sq) slices, up to `block` elements per block,
    in order. Views: an in-place update must never land in a copy (the gradient only read)."""
    out: list[Block] = []
    fill = block
    for p, state in zip(params, states):
        flat = [p.view(-1), p.grad.reshape(-1)]
        flat += [state[k].view(-1) for k in ("exp_avg", "exp_avg_sq")]
        lo = 0
        while lo < p.numel():
            if fill == block:
                out.append(([], [], [], []))
                fill = 0
            hi = min(p.numel(), lo + block - fill)
            for dst, t in zip(out[-1], flat):
                dst.append(t[lo:hi])
            fill += hi - lo
            lo = hi
    return out


def _cached_blocks(opt, group_index: int, params, states, block: int) -> list[Block]:
    """`_blocks`, made again only when a tensor or the set of stepped parameters changes (the
    key holds the tensors themselves, so no id is reused while it is kept). A non-contiguous
    gradient's flat view is a copy, remade every step: never kept."""
    if not all([p.grad.is_contiguous() for p in params]):
        return _blocks(params, states, block)
    cache = opt.__dict__.setdefault("_nanotron_blocks", {})
    key = [t for p, st in zip(params, states) for t in (p, p.grad, st["exp_avg"], st["exp_avg_sq"])]
    hit = cache.get(group_index)
    same = hit is not None and hit[0] == block and len(hit[1]) == len(key)
    if same and all(map(operator.is_, hit[1], key)):
        return hit[2]
    made = _blocks(params, states, block)
    cache[group_index] = (block, key, made)
    return made


def _step_blocks(blocks: list[Block], group: dict, tensors: dict, step: float) -> None:
    """AdamW's passes on each block, in torch's per-tensor order (`tensors`: the 0-d
    `decay` (None without weight decay), `beta2` and `eps`)."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    decay, eps = tensors["decay"], tensors["eps"]
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = _scalar((1 - beta2**step) ** 0.5)
    for params, grads, exp_avgs, exp_avg_sqs in blocks:
        if decay is not None:
            torch._foreach_mul_(params, decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, tensors["beta2"])
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, [eps] * len(denom))  # (one 0-d tensor: read as a float)
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


@torch.no_grad()
def blocked_adamw_step(opt: torch.optim.AdamW, block: int = BLOCK) -> None:
    """One step of `opt` (an AdamW without amsgrad, maximize or complex parameters) over the
    parameters that have a gradient, block by block."""
    for gi, group in enumerate(opt.param_groups):
        lr, wd = group["lr"], group["weight_decay"]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [_state(opt, p) for p in params]
        steps = _advance_steps(opt, gi, [s["step"] for s in states])
        tensors = {
            "decay": _scalar(1 - lr * wd) if wd != 0 else None,
            "beta2": _constant(group["betas"][1]),
            "eps": _constant(group["eps"]),
        }
        if len(set(steps)) == 1:  # always, unless a parameter went without a gradient
            blocks = _cached_blocks(opt, gi, params, states, block)
            _step_blocks(blocks, group, tensors, steps[0])
            continue
        for p, state, step in zip(params, states, steps):  # each its own bias correction
            _step_blocks(_blocks([p], [state], block), group, tensors, step)


def supports_blocked(opt: torch.optim.Optimizer) -> bool:
    """Whether `blocked_adamw_step` is `opt.step()` bitwise: a plain AdamW on the CPU, fp32
    contiguous parameters."""
    if type(opt) is not torch.optim.AdamW:
        return False
    for group in opt.param_groups:
        if group["amsgrad"] or group["maximize"] or group["fused"] or group["capturable"]:
            return False
        if group["differentiable"]:
            return False
        for p in group["params"]:
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                return False
    return True
