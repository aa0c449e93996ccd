"""The training step never waits for the device: counted with the profiler on the CPU.

A host sync shows up as one of the ops that copy a device scalar to the host
(`aten::_local_scalar_dense`, `aten::item`, `aten::is_nonzero`). One unlogged training step
must run none of them, at several layouts; a logged step reads exactly two values (the loss and
the gradient norm). The gradient norm is one call per view (on the CPU a 2-D view norms its 16k
rows at once), no pass clears the gradient buffers (the step's first gradient is written), and
the linears' weight gradients never pass through autograd (their matmuls accumulate into the
buffers). The pipeline's p2p payload messages per step equal the schedule's count, and after
the first step (which agrees the shapes) no header is sent. AdamW's step counters are not read
back, RoPE without position ids gathers nothing, and one process's step stays under a ceiling
of aten ops (MAX_OPS_PER_STEP): counts, not timings, so a fixed cost cannot come back quietly.

Expert parallelism is the exception, counted where it is tested (tests/train/test_moe_train.py):
each dispatcher reads its split sizes on the host once per MoE layer and micro-batch
(`ep.host_read` in the profile), and nothing else.
"""

from __future__ import annotations

import copy
import functools
import io
import math
import re

import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.test_equivalence_perf import perf_config

SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero")
_PAYLOADS = re.compile(r"pp\.p2p\.payloads sends=(\d+) recvs=(\d+)")


def _events(fn) -> tuple[dict[str, int], object]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        value = fn()
    counts: dict[str, int] = {}
    for e in prof.events():
        name = e.name
        if name in SYNC_OPS and _in_optimizer(e):
            name += " (optimizer step counter)"
        if name == "aten::linalg_vector_norm" and _under(e, "RMSNormFunction"):
            name += " (RMSNorm's sum of squares)"  # not the gradient norm's
        if name in ("aten::zero_", "aten::fill_") and e.input_shapes and e.input_shapes[0]:
            name += f" numel={math.prod(e.input_shapes[0])}"  # which buffer it cleared
        counts[name] = counts.get(name, 0) + 1
    return counts, value


def _under(event, range_name: str) -> bool:
    while event is not None:
        if event.name == range_name:
            return True
        event = event.cpu_parent
    return False


def _in_optimizer(event) -> bool:
    """torch's AdamW reads its step counters with .item(); they live on the host unless the
    optimizer is fused or capturable (then no read at all), so these are no device syncs."""
    while event is not None:
        if event.name.startswith("Optimizer.step#"):
            return True
        event = event.cpu_parent
    return False


def expected_messages(layout: dict, pp_rank: int) -> tuple[int, int]:
    """(sends, receives) of this stage in one step, from the schedule."""
    pp, m, engine = layout["pp"], 4 // layout["dp"], layout.get("engine")
    if engine in ("interleaved-1f1b", "zb-h1", "zbv"):
        from nanotron_parallel.pipeline.interleaved import plan_interleaved
        from nanotron_parallel.pipeline.zb_plan import plan as plan_zb

        plan = plan_interleaved(pp, layout["v"], m) if layout.get("v") else plan_zb(engine, pp, m)
        msgs = [msg for slot in plan.messages for msg in slot if msg.src != msg.dst]
        return sum(x.src == pp_rank for x in msgs), sum(x.dst == pp_rank for x in msgs)
    ends = (pp_rank > 0) + (pp_rank < pp - 1)  # each neighbour: m activations or m gradients
    return ends * m, ends * m


def count_step_syncs(layouts: list[dict]) -> list[dict]:
    """On every rank: build each layout's Trainer, run two steps, profile the third (and its
    record, as a logged step would make it)."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for layout in layouts:
            raw = perf_config(layout)
            raw["logging"]["iteration_step_info_interval"] = 1000
            cfg = config_from_dict(raw, "test", world_size=None)
            pc = ParallelContext(
                dp=layout["dp"], tp=layout["tp"], pp=layout["pp"],
                tensor_collectives=layout.get("tensor_collectives"), cp=layout.get("cp", 1),
            )  # fmt: skip
            try:
                trainer = Trainer(cfg, pc, stream=io.StringIO())
                first, _ = _events(trainer.train_step)  # agrees the p2p shapes
                trainer.train_step()
                step, result = _events(trainer.train_step)
                record, rec = _events(functools.partial(trainer.step_record, result, 1.0))
                inner = trainer.state.optimizer.inner
                norm_views = len(trainer.norm_views)
                # buffers of several parameters (a one-parameter buffer has the size of the
                # embedding's own backward zero-fill, so it cannot be told apart by size)
                buffers = {b.grad.numel() for b in trainer.grads.buckets if len(b.params) > 1}
                on_host = all(st["step"].device.type == "cpu" for st in inner.state.values())
                unfused = _params_through_autograd(trainer)
                linears = len(_fused_linears(trainer))
                trainer.close()
            finally:
                dist.barrier()
                pc.destroy()
            payloads = [
                tuple(map(int, m.groups()))
                for name, n in step.items()
                if (m := _PAYLOADS.fullmatch(name))
                for _ in range(n)
            ]
            out.append({
                "step_syncs": {op: step.get(op, 0) for op in SYNC_OPS},
                "record_reads": record.get("aten::_local_scalar_dense", 0),
                "sends": sum(s for s, _ in payloads),
                "recvs": sum(r for _, r in payloads),
                "headers": step.get("pp.p2p.headers", 0),
                "first_headers": first.get("pp.p2p.headers", 0),
                "pp_rank": pc.pp_rank,
                "optimizer_counters_on_host": on_host,
                # the gradient norm: one call per view; the buffers: never cleared in a pass
                "norm_calls": step.get("aten::linalg_vector_norm", 0),
                "norm_views": norm_views,
                "buffers": sorted(buffers),
                "buffer_clears": sum(
                    n for name, n in step.items()
                    if name.startswith(("aten::zero_ numel=", "aten::fill_ numel="))
                    and int(name.rsplit("=", 1)[1]) in buffers
                ),
                "loss": rec["lm_loss"],
                # the step's ops, nested ones included (a per-step or per-parameter regression)
                "aten_ops": sum(n for name, n in step.items() if name.startswith("aten::")),
                "counter_reads": sum(
                    n for name, n in step.items() if name.endswith("(optimizer step counter)")
                ),
                # RoPE without position ids: slices of the table, no positions nor gather
                "rope_gathers": step.get("aten::arange", 0) + step.get("aten::index", 0),
                # gradients accumulated by autograd, not by the linears' fused matmuls
                "through_autograd": step.get("torch::autograd::AccumulateGrad", 0),
                "expected_through_autograd": unfused * 4 // layout["dp"],
                # the linears' forward and input-gradient GEMMs (tensor_parallel/cpu_gemm.py)
                "onednn_gemms": step.get("mkldnn::_linear_pointwise", 0),
                "linear_calls": 2 * linears * 4 // layout["dp"],
            })  # fmt: skip
    return out


def _fused_linears(trainer) -> list:
    """The linears that accumulate their own weight gradient (gradient-accumulation fusion)."""
    from nanotron_parallel.tensor_parallel.layers import _TPLinearBase

    return [
        m
        for m in trainer.state.model.modules()
        if isinstance(m, _TPLinearBase) and m.fuse_grad_accumulation
    ]


def _params_through_autograd(trainer) -> int:
    """Parameters whose gradient autograd accumulates: all but the fused linears' weights."""
    fused = {id(m.weight) for m in _fused_linears(trainer)}
    return sum(id(p) not in fused for _, p in trainer.named_params)


def check(layouts: list[dict], per_rank: list[list[dict]]) -> None:
    for results in per_rank:
        for layout, res in zip(layouts, results, strict=True):
            assert res["step_syncs"] == dict.fromkeys(SYNC_OPS, 0), (layout, res)
            assert res["optimizer_counters_on_host"], res
            assert res["record_reads"] == 2, (layout, res)  # the loss and the grad norm
            assert res["norm_calls"] == res["norm_views"] > 0, (layout, res)
            assert res["buffer_clears"] == 0 and res["buffers"], (layout, res)
            want = expected_messages(layout, res["pp_rank"])
            assert (res["sends"], res["recvs"]) == want, (layout, res, want)
            assert res["headers"] == 0, (layout, res)
            if layout["pp"] > 1:
                assert res["first_headers"] > 0, (layout, res)  # shapes agreed on step 1
            assert 4.0 < res["loss"] < 7.0, res
            assert res["counter_reads"] == 0, (layout, res)  # AdamW's counters kept on the host
            if layout.get("cp", 1) == 1:  # (under cp the batches carry positions)
                assert res["rope_gathers"] == 0, (layout, res)
            if layout["pp"] == 1 and not layout.get("async"):  # (a stage's received
                # activations are leaves too; the async linears gather their own inputs)
                assert res["through_autograd"] == res["expected_through_autograd"], (layout, res)
                # a forward and an input gradient per linear and micro-batch through oneDNN
                # (more under recompute, and the fused loss's lm_head)
                assert res["onednn_gemms"] >= res["linear_calls"] > 0, (layout, res)


# aten ops of one unlogged step of the test model (nested ones included), one process without
# and with recompute: 7150 and 9358 now (the linears' oneDNN GEMMs are one mkldnn op each,
# where F.linear dispatched several aten ops), 7306 and 9770 before them, 7681 and 10465
# before the RoPE table slices and the optimizer's kept step counters. The ceilings sit ~2%
# above, so that a new fixed cost per step, layer or parameter fails here; lower them when
# the count falls.
MAX_OPS_PER_STEP = (7300, 9550)


def test_single_process_step_has_no_host_sync():
    layouts = [{"dp": 1, "tp": 1, "pp": 1}, {"dp": 1, "tp": 1, "pp": 1, "recompute": True}]
    results = count_step_syncs(layouts)
    check(layouts, [results])
    for res, ceiling in zip(results, MAX_OPS_PER_STEP, strict=True):
        assert res["aten_ops"] <= ceiling, (res["aten_ops"], ceiling)


def test_two_rank_layouts_step_has_no_host_sync():
    """dp=2 with ZeRO-1 on NCCL's code paths (reduce-scatter, all-gather into one tensor),
    tp=2 sequence parallel with async linears and native reduce-scatter, pp=2 with 1F1B, and
    interleaved 1F1B (v=2), context parallel (cp=2, K/V gathered), zb-h1 and zbv: each
    message count is the schedule's."""
    layouts = [
        {"dp": 2, "tp": 1, "pp": 1, "zero": 1, "tensor_collectives": True},
        {"dp": 1, "tp": 2, "pp": 1, "mode": "REDUCE_SCATTER", "async": True,
         "tensor_collectives": True},
        {"dp": 1, "tp": 1, "pp": 2},
        {"dp": 1, "tp": 1, "pp": 2, "engine": "interleaved-1f1b", "v": 2},
        {"dp": 1, "tp": 1, "pp": 1, "cp": 2},
        {"dp": 1, "tp": 1, "pp": 2, "engine": "zb-h1"},
        {"dp": 1, "tp": 1, "pp": 2, "engine": "zbv"},  # + the loss's hand-over: no host read
    ]  # fmt: skip
    check(layouts, run_distributed(count_step_syncs, 2, copy.deepcopy(layouts), timeout=300))
