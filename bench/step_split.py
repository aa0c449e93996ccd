"""Helpers of bench/roofline.py: a training step's GEMMs (captured, then replayed alone) and
the split of a profiled step into matmul, attention, other ops, optimizer, communication and
host time.

The GEMMs are captured with a TorchDispatchMode during one step: every `mm`, `addmm`,
`addmm_`, `bmm`, `baddbmm` and oneDNN linear (`mkldnn::_linear_pointwise`) call with its
tensors' shapes and strides (a transposed operand stays transposed) and its other arguments.
`GemmReplay` runs the same calls, in the step's order, on tensors of the same layouts: the
machine's matmul throughput for the step's own shapes, each weighted by its share of the
FLOPs; `GemmReplay(calls, blas=True)` runs the oneDNN linears through torch's BLAS instead.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "_linear_pointwise")
# oneDNN's linear (tensor_parallel/cpu_gemm.py): X [..., k] W^T with W [n, k]
LINEAR = "_linear_pointwise"
OPTIMIZER_RANGE = "roofline.optimizer"  # the bench wraps norm, clip and the step in it
STEP_RANGE = "roofline.step"
# The frameworks' own ranges around each collective and its wait (a blocking gloo call waits
# outside any aten op: without these its wait would count as host time)
COMM_RANGES = ("tp.all_reduce", "tp.all_gather", "tp.reduce_scatter", "dp.reduce_launch",
               "dp.reduce_wait", "pp.p2p", "ep.", "zero3.gather")  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _spec(x):
    if isinstance(x, torch.Tensor):
        return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, list):  # oneDNN's linear takes a list of scalars: kept hashable
        return tuple(x)
    return x


def gemm_flops(name: str, args: tuple) -> int:
    """2 x multiply-adds of one call (the operands are the last two tensor arguments; oneDNN's
    linear: the first two, X and W)."""
    if name == LINEAR:
        x, w = args[0], args[1]
        rows = 1
        for n in x.shape[:-1]:
            rows *= n
        return 2 * rows * x.shape[-1] * w.shape[0]
    a, b = [x for x in args if isinstance(x, TensorSpec)][-2:]
    if name in ("bmm", "baddbmm"):
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


class GemmCapture(TorchDispatchMode):
    """Records (op, argument specs, keyword specs) of every GEMM run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in GEMMS:
            specs = tuple(_spec(a) for a in args)
            kw = tuple(sorted((k, _spec(v)) for k, v in kwargs.items()))
            self.calls.append((func, specs, kw))
        return func(*args, **kwargs)


def _make(x, cache: dict):
    if isinstance(x, tuple):
        return list(x)
    if not isinstance(x, TensorSpec):
        return x
    if x not in cache:  # one tensor per layout, reused: like the step, inputs of this size
        size = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride))
        storage = torch.randn(size, dtype=x.dtype).mul_(0.01)
        cache[x] = storage.as_strided(x.shape, x.stride)
    return cache[x]


def _through_blas(func, args: tuple) -> tuple:
    """oneDNN's linear as F.linear (torch's BLAS) on the same tensors; other calls as they are."""
    if func.overloadpacket.__name__ == LINEAR:
        return torch.ops.aten.linear.default, args[:3]
    return func, args


class GemmReplay:
    """The captured GEMMs of one step, runnable alone, in the step's order; with `blas`, the
    oneDNN linears (tensor_parallel/cpu_gemm.py) replayed through torch's BLAS instead."""

    def __init__(self, calls: list[tuple], blas: bool = False) -> None:
        cache: dict = {}
        self.calls = []
        for func, args, kw in calls:
            made = tuple(_make(a, cache) for a in args)
            if blas:
                func, made = _through_blas(func, made)
            self.calls.append((func, made, {k: _make(v, cache) for k, v in kw}))
        self.flops = sum(gemm_flops(f.overloadpacket.__name__, a) for f, a, _ in calls)
        self.shapes = Counter((f.overloadpacket.__name__, a) for f, a, _ in calls)

    @torch.no_grad()
    def seconds(self) -> float:
        t = time.perf_counter()
        for func, args, kwargs in self.calls:
            func(*args, **kwargs)
        return time.perf_counter() - t


def _category(name: str) -> str:
    if name.startswith(("c10d::", "gloo:")) or "record_param_comms" in name:
        return "communication"
    short = name.removeprefix("aten::").removeprefix("mkldnn::")
    if short in GEMMS or short == "_addmm_activation":
        return "matmul"
    if (
        "scaled_dot_product" in short
        or "flash_attention" in short
        or "efficient_attention" in short
    ):
        return "attention"
    return "other ops"


def _counted_above(ev) -> bool:
    """Whether a range above `ev` counts whole: the optimizer's or a collective's."""
    parent = ev.cpu_parent
    while parent is not None:
        if parent.name == OPTIMIZER_RANGE or parent.name.startswith(COMM_RANGES):
            return True
        parent = parent.cpu_parent
    return False


def split_profile(events, steps: int, wall_s: float) -> tuple[dict[str, float], Counter]:
    """Seconds per step of each category (the step's thread only), and the ops' counts per
    step. `host` is the step's wall time that no op covers (Python, autograd's engine,
    the profiler's own cost), outside the optimizer's range and the collectives' ranges
    (COMM_RANGES: the call and its wait), which count whole."""
    main = {ev.thread for ev in events if ev.name == STEP_RANGE}
    cats = Counter({"matmul": 0.0, "attention": 0.0, "other ops": 0.0, "optimizer": 0.0,
                    "communication": 0.0})  # fmt: skip
    counts: Counter = Counter()
    for ev in events:
        if ev.thread not in main:
            continue
        if ev.name == OPTIMIZER_RANGE:
            cats["optimizer"] += ev.cpu_time_total / 1e6
            continue
        if ev.name.startswith(COMM_RANGES) and not _counted_above(ev):
            cats["communication"] += ev.cpu_time_total / 1e6
            continue
        is_op = ev.name.startswith(("aten::", "mkldnn::", "c10d::", "gloo:"))
        is_op = is_op or "record_param" in ev.name
        if not is_op:
            continue
        counts[ev.name] += 1
        if not _counted_above(ev):
            cats[_category(ev.name)] += ev.self_cpu_time_total / 1e6
    per_step = {k: v / steps for k, v in cats.items()}
    per_step["host (outside ops)"] = wall_s / steps - sum(per_step.values())
    return per_step, Counter({k: v / steps for k, v in counts.items()})
