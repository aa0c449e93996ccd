"""Per-layer statistics (`metrics_logging.log_level: 1`, reporting/layer_stats.py).

One process: the detail step's weight norm, gradient norm and update/weight ratio equal the
values computed from the parameters before and after the step (and the gradient norms add up
to the step's global norm); each attention layer's max logit equals the largest causal
q.k/sqrt(d) of the q and k it attended with; each router's entropy equals the mean entropy of
the probabilities it returned (a Qwen2-MoE model); the steps without statistics run no host
sync, register no hook and leave no probe set. Layouts, in one launch of 4 processes: tp=2 x
pp=2 (tied embedding on both ends), dp=2 ZeRO-3 x tp=2 sequence parallel, dp=2 ZeRO-1 x pp=2,
cp=2 x dp=2 with each context-parallel attention (all-gather, ring) and cp=2 (Ulysses) x tp=2,
and the MoE model (under µP) at tp=2 sequence parallel x dp=2 give every statistic of every row
(parameters, blocks, attention layers, routers) within 1e-5 of one process.
"""

from __future__ import annotations

import io
import math
import tempfile
from pathlib import Path

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.test_equivalence import layout_config
from tests.train.test_step_syncs import SYNC_OPS, _events

REL = 1e-5
DETAIL = 2  # log_detail_interval: step 2 has the statistics
# one launch of 4 processes; each layout uses all of them
LAYOUTS = [
    {"dp": 1, "tp": 2, "pp": 2},  # tied embedding on both stages
    {"dp": 2, "tp": 2, "pp": 1, "zero": 3, "mode": "REDUCE_SCATTER"},  # sequence-sharded
    {"dp": 2, "tp": 1, "pp": 2, "zero": 1},
    {"dp": 2, "tp": 1, "pp": 1, "cp": 2},  # all-gather context-parallel attention
    {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "par": {"cp_attention": "ulysses"}},
    {"dp": 2, "tp": 1, "pp": 1, "cp": 2, "par": {"cp_attention": "ring"}},  # its own blocks
]
MOE_LAYOUTS = [
    {"dp": 2, "tp": 2, "pp": 1, "mode": "REDUCE_SCATTER", "moe": True},
]


def _config(layout: dict):
    from nanotron_train.config import config_from_dict

    if layout.get("moe"):  # Qwen2-MoE at test sizes, both layers experts
        from tests.train.test_moe_metrics import tiny_moe

        raw = tiny_moe(Path(tempfile.gettempdir()))
        raw["logging"].pop("metrics_file")
        raw["parallelism"].update(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"])
        raw["parallelism"]["tp_mode"] = layout.get("mode", "ALL_REDUCE")
        raw["parallelism"]["tp_linear_async_communication"] = False
        raw["tokens"]["batch_accumulation_per_replica"] = 2 // layout["dp"]
        # under µP (test_mup_moe.py): the update ratios check its per-parameter rates too
        raw["model"]["parametrization"] = {"name": "mup", "base_hidden_size": 16}
    else:
        raw = layout_config(layout)
        raw["model"]["model_config"]["num_hidden_layers"] = 2  # one per pp stage: cheaper
    raw["logging"]["iteration_step_info_interval"] = 1000  # only the detail step is logged
    raw["metrics_logging"] = {"log_level": 1, "log_detail_interval": DETAIL}
    raw["tokens"]["train_steps"] = DETAIL
    return config_from_dict(raw, "test", world_size=None)


def layout_stats(layouts: list[dict]) -> list[dict]:
    """On every rank: train each layout DETAIL steps; the detail step's statistics."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for layout in layouts:
            pc = ParallelContext(
                dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], cp=layout.get("cp", 1)
            )
            records: list[dict] = []
            try:
                Trainer(_config(layout), pc, stream=io.StringIO()).train(records.append)
            finally:
                dist.barrier()
                pc.destroy()
            out.append(records[-1]["layer_stats"])
    return out


def _capture(model, seen: dict) -> list:
    """For one step: every attention layer's (q, k) as it attends and every router's output
    probabilities, by module name; returns what undoes it."""
    from nanotron_models.probes import detail_probes

    undo = []
    for name, module in detail_probes(model):
        calls = seen.setdefault(name, [])
        if hasattr(module, "attend"):  # attention: the q and k it attends with

            def attend(q, k, *rest, _calls=calls, _orig=module.attend):
                _calls.append((q.detach().clone(), k.detach().clone()))
                return _orig(q, k, *rest)

            module.attend = attend
            undo.append(lambda m=module: delattr(m, "attend"))
        else:  # a router's probabilities

            def hook(_m, _i, out, _calls=calls):
                _calls.append(out.probs.detach().clone())

            undo.append(module.router.register_forward_hook(hook).remove)
    return undo


def _run_one_process(layout: dict) -> dict:
    """Steps 1-3 of one process, profiled; the parameters around the detail step, the
    attention q/k and router probabilities of its forward passes."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    pc = ParallelContext(dp=1, tp=1, pp=1)
    try:
        t = Trainer(_config(layout), pc, stream=io.StringIO())
        first, _ = _events(t.train_step)
        before = {n: p.detach().clone() for n, p in t.named_params}
        seen: dict = {}
        undo = _capture(t.state.model, seen)
        _, out = _events(t.train_step)  # the detail step
        for u in undo:
            u()
        after = {n: p.detach().clone() for n, p in t.named_params}
        record = t.step_record(out, 1.0)
        third, _ = _events(t.train_step)
        hooks = sum(len(m._forward_hooks) for m in t.state.model.modules())
        probes = [n for n, m in t.state.model.named_modules() if getattr(m, "probe", None)]
        norm_views = len(t.norm_views)
        t.close()
    finally:
        pc.destroy()
    return {"first": first, "third": third, "hooks": hooks, "record": record, "seen": seen,
            "before": before, "after": after, "norm_views": norm_views, "probes": probes}  # fmt: skip


@pytest.fixture(scope="module")
def one_process() -> dict:
    return _run_one_process({"dp": 1, "tp": 1, "pp": 1})


@pytest.fixture(scope="module")
def moe_one_process() -> dict:
    return _run_one_process({"dp": 1, "tp": 1, "pp": 1, "moe": True})


def _hand_max_logit(calls: list) -> float:
    """The largest causal q.k/sqrt(d) over heads, positions and calls, in float64."""
    best = -math.inf
    for q, k in calls:
        s, _, h, d = q.shape
        keys = k.double().repeat_interleave(h // k.shape[2], dim=2)  # grouped-query heads
        scores = torch.einsum("qbhd,kbhd->bhqk", q.double(), keys) / math.sqrt(d)
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        best = max(best, scores.masked_fill(future, -math.inf).max().item())
    return best


def test_max_attention_logit_equals_the_layers_q_and_k(one_process):
    got = one_process["record"]["layer_stats"]["attn_max_logit"]
    seen = one_process["seen"]
    assert list(got) == ["decoder.0.attn", "decoder.1.attn"]
    for name, value in got.items():
        assert len(seen[name]) == 4  # every micro-batch of the step
        assert value == pytest.approx(_hand_max_logit(seen[name]), rel=1e-6), name


def test_router_entropy_equals_the_routers_probabilities(moe_one_process):
    got = moe_one_process["record"]["layer_stats"]["router_entropy"]
    seen = moe_one_process["seen"]
    assert list(got) == ["decoder.0.mlp", "decoder.1.mlp"]
    for name, value in got.items():
        p = torch.cat(seen[name]).double()  # [tokens of every micro-batch, experts]
        want = -(p * p.log()).sum(-1).mean().item()
        assert 0 < want < math.log(p.shape[1])  # neither one-hot nor uniform
        assert value == pytest.approx(want, rel=1e-9), name


def test_statistics_equal_the_parameters_before_and_after_the_step(one_process):
    rec, before, after = one_process["record"], one_process["before"], one_process["after"]
    stats = rec["layer_stats"]
    assert list(stats["weight_norm"]) == list(before)  # every parameter, in model order
    for name, w in before.items():
        norm = w.double().norm().item()
        assert stats["weight_norm"][name] == pytest.approx(norm, rel=1e-9)
        moved = (after[name].double() - w.double()).norm().item()
        assert stats["update_ratio"][name] == pytest.approx(moved / norm, rel=1e-6)
    # the per-parameter gradient norms are the pieces of the step's (pre-clipping) norm
    total = math.sqrt(sum(g * g for g in stats["grad_norm"].values()))
    assert total == pytest.approx(rec["grad_norm"], rel=1e-6)
    assert rec["grad_norm"] > 0.5  # above clip_grad: the norms are taken before clipping
    blocks = ["embedding", "decoder.0", "decoder.1", "final_norm"]
    assert list(stats["act_rms"]) == blocks  # hidden states only: not the logits or loss
    assert all(0 < v < 10 for v in stats["act_rms"].values())


def test_steps_without_statistics_have_no_host_sync_and_no_hook(one_process, moe_one_process):
    for run, step in [(r, s) for r in (one_process, moe_one_process) for s in ("first", "third")]:
        events = run[step]  # before and after the detail step
        syncs = {op: events.get(op, 0) for op in SYNC_OPS}
        if run is one_process:
            assert syncs == dict.fromkeys(SYNC_OPS, 0), step
        else:  # the local dispatcher reads its expert counts: the same on both steps
            assert syncs == {op: run["first"].get(op, 0) for op in SYNC_OPS}, step
        # the step's only norms are the gradient norm's views: no statistics computed
        assert events.get("aten::linalg_vector_norm", 0) == run["norm_views"], step
        assert events.get("aten::special_xlogy", 0) == 0, step  # no router entropy
        assert run["hooks"] == 0 and run["probes"] == []
    # the detail step did measure them (the op names the line above counts are the right ones)
    assert moe_one_process["record"]["layer_stats"]["router_entropy"]


def test_every_layout_gives_one_process_statistics(one_process, moe_one_process):
    dense, moe = one_process["record"]["layer_stats"], moe_one_process["record"]["layer_stats"]
    got = run_distributed(layout_stats, 4, LAYOUTS + MOE_LAYOUTS, timeout=300)[0]
    for layout, stats in zip(LAYOUTS + MOE_LAYOUTS, got, strict=True):
        want = moe if layout.get("moe") else dense
        assert stats.keys() == want.keys(), layout
        for stat, rows in want.items():
            assert list(stats[stat]) == list(rows), (layout, stat)
            for row, v in rows.items():
                assert stats[stat][row] == pytest.approx(v, rel=REL), (layout, stat, row)


@pytest.mark.parametrize(
    "key, bad, says",
    [("log_level", 2, "must be 0 (basic) or 1"), ("log_detail_interval", 0, "must be >= 1")],
)
def test_a_bad_value_is_one_line_naming_the_key(key, bad, says):
    from nanotron_train.config import ConfigError, config_from_dict

    raw = layout_config({"dp": 1, "tp": 1, "pp": 1})
    raw["metrics_logging"] = {"log_level": 1, key: bad}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "run.yaml", world_size=None)
    assert str(err.value).startswith(f"run.yaml: metrics_logging.{key}: {says}"), str(err.value)
