"""The planner's communication model (nanotron_train/plan/comm.py) against the bytes a training
step hands to each process group's collectives, counted by wrapping torch.distributed's
collectives in every rank: tp (all-reduce; sequence parallel's all-gathers, reduce-scatters
and norm-gradient all-reduces), cp (all-gather, ring, Ulysses' all-to-alls), ep (all-to-all,
summed over the ep group: a rank's received rows depend on the routing), pp (sends) and dp
(the dense and expert gradients' reductions, and the ZeRO-1/2/3 parameter gathers over the
same group) equal the prediction exactly, with recompute too; for the Mamba-2 hybrid (one
tp block per layer; cp: Mamba-2's halo and state passing beside the attention's all-gather)
and Qwen3-Next (the Gated DeltaNet's state passing, the MoE balance sums over cp) as well. Calls of at most 8 bytes (the
logged loss, the gradient norm) are scalars the model leaves out. One world-4 launch."""

from __future__ import annotations

import collections
import importlib
import io

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.test_plan_memory import raw

OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single", "broadcast")  # fmt: skip
KINDS = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp_cp": "dp", "edp_cp": "dp"}
ALIASED = [f"nanotron_parallel.{m}" for m in (
    "tensor_parallel.functional", "tensor_parallel.async_linear", "data_parallel.zero",
    "data_parallel.zero3", "context_parallel.allgather", "context_parallel.state_passing",
)]  # fmt: skip
LAYOUTS = {
    "dp2 tp2 recompute zero2": dict(dp=2, tp=2, recompute=True, zero=2),
    "pp2 dp2 1f1b zero3": dict(pp=2, dp=2, m=4, mbs=2, zero=3),
    "cp2 dp2 all-gather zero1": dict(cp=2, dp=2, zero=1),
    "cp4 ring": dict(cp=4, cp_attention="ring"),
    "moe dp4 ep2": dict(family="moe", dp=4, ep=2, m=1),
    "tp2 dp2 sequence parallel": dict(tp=2, dp=2, mode="REDUCE_SCATTER", m=1),
    "tp2 dp2 sequence parallel recompute": dict(tp=2, dp=2, mode="REDUCE_SCATTER", recompute=True),
    "cp4 ulysses (kv heads repeated)": dict(cp=4, cp_attention="ulysses", m=1),
    "mamba-2 hybrid cp2 tp2 (Mamba-2 state passing)": dict(family="hybrid", cp=2, tp=2),
    "qwen3-next cp2 dp2 (Gated DeltaNet state passing)": dict(family="qwen3-next", cp=2, dp=2, m=1),
}


def _nbytes(x) -> int:
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if torch.is_tensor(x) else 0


class Counter:
    """Bytes per group kind while `on`: the first tensor argument of each collective (an
    all-gather's output list or tensor: the whole gathered payload) and each p2p send."""

    def __init__(self, dist) -> None:
        self.dist, self.on, self.pc = dist, False, None
        self.bytes: collections.Counter = collections.Counter()
        for name in OPS:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))
        # The tensor-in/tensor-out collectives (dist.all_gather_single, reduce_scatter_single)
        # are bound by name where they are imported: wrapped there too, or every all-gather
        # of sequence parallel, cp and ZeRO-3 goes uncounted
        for module in ALIASED:
            mod = importlib.import_module(module)
            for alias in ("_all_gather_tensor", "_reduce_scatter_tensor"):
                if hasattr(mod, alias):
                    setattr(mod, alias, self._wrap(alias, getattr(mod, alias)))
        batch = dist.batch_isend_irecv

        def batch_isend_irecv(ops):
            for op in ops:
                if op.op is dist.isend:
                    self._add(op.group, op.tensor)
            return batch(ops)

        dist.batch_isend_irecv = batch_isend_irecv

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            self._add(kwargs.get("group"), args[0] if args else kwargs.get("tensor"))
            return fn(*args, **kwargs)

        return wrapped

    def _add(self, group, tensor) -> None:
        size = _nbytes(tensor)
        if not self.on or size <= 8:
            return
        kind = next((k for k in KINDS if group is getattr(self.pc, f"{k}_group")), None)
        if kind is not None:
            self.bytes[KINDS[kind]] += size


def count(layouts: list[dict]) -> list[dict]:
    """On every rank: each layout's counted bytes per kind in step 2, and the prediction."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.plan.comm import collectives
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    counter = Counter(dist)
    out = []
    with shared_default_group():
        for layout in layouts:
            data = raw(layout)
            data["tokens"]["train_steps"] = 3
            cfg = config_from_dict(data, "plan-comm", world_size=None)
            p = cfg.parallelism
            pc = ParallelContext(
                dp=p.dp, tp=p.tp, pp=p.pp, cp=p.context_parallel_size, ep=p.expert_parallel_size
            )
            counter.pc, counter.bytes = pc, collections.Counter()
            snap = {}

            def on_record(rec, snap=snap):  # step 2 only: step 1 negotiates shapes
                counter.on = rec["step"] == 1
                counter.bytes.clear() if rec["step"] == 1 else snap.update(counter.bytes)

            try:
                trainer = Trainer(cfg, pc, stream=io.StringIO())
                params = sum(q.numel() for q in trainer.state.model.parameters())
                trainer.train(on_record=on_record, every_step=True)
            finally:
                counter.on = False
                dist.barrier()
                pc.destroy()
            mc = cfg.model.model_config
            moe = getattr(mc, "moe_config", None)
            moe_layers = len(moe.moe_layers(mc.num_hidden_layers)) if moe else 0
            predicted = collections.Counter()
            for c in collectives(cfg, params, moe_layers, mc.num_hidden_layers // p.pp, pc.pp_rank):
                predicted["dp" if c.kind == "zero_gather" else c.kind] += c.bytes
            if pc.dp_cp_group is pc.cp_group:  # dp = 1: one group, counted as cp
                predicted["cp"] += predicted.pop("dp", 0)
            out.append({"counted": dict(snap), "predicted": dict(predicted), "ep_rank": pc.ep_rank})
    return out


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return run_distributed(count, 4, list(LAYOUTS.values()), timeout=600)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=list(LAYOUTS))
def test_predicted_bytes_equal_counted_bytes(results, index):
    ranks = [r[index] for r in results]
    for r in ranks:
        counted = {k: v for k, v in r["counted"].items() if k != "ep"}
        predicted = {k: v for k, v in r["predicted"].items() if k != "ep"}
        assert counted == predicted and counted, r
    if "ep" in ranks[0]["predicted"]:  # each ep group's sum (ranks 0-1 and 2-3)
        for group in (ranks[:2], ranks[2:]):
            assert sum(r["counted"]["ep"] for r in group) == sum(
                r["predicted"]["ep"] for r in group
            ), group
