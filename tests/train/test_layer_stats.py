"""Per-layer statistics (`metrics_logging.log_level: 1`, reporting/layer_stats.py).

One process: the detail step's weight norm, gradient norm and update/weight ratio equal the
values computed from the parameters before and after the step (and the gradient norms add up
to the step's global norm); the steps without statistics run no host sync and register no
hook. Layouts: tp=2 (ALL_REDUCE and sequence parallel), pp=2 (tied embedding on both ends),
dp=2 ZeRO-1 and dp=2 ZeRO-3 in one launch give every statistic of every row (parameters and
blocks) within 1e-5 of one process.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.test_equivalence import layout_config
from tests.train.test_step_syncs import SYNC_OPS, _events

REL = 1e-5
DETAIL = 2  # log_detail_interval: step 2 has the statistics
LAYOUTS = [
    {"dp": 1, "tp": 2, "pp": 1},
    {"dp": 1, "tp": 2, "pp": 1, "mode": "REDUCE_SCATTER"},  # sequence-sharded activations
    {"dp": 1, "tp": 1, "pp": 2},
    {"dp": 2, "tp": 1, "pp": 1, "zero": 1},
    {"dp": 2, "tp": 1, "pp": 1, "zero": 3},
]


def _config(layout: dict):
    from nanotron_train.config import config_from_dict

    raw = layout_config(layout)
    raw["model"]["model_config"]["num_hidden_layers"] = 2  # one per pp stage: a cheaper test
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
            pc = ParallelContext(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"])
            records: list[dict] = []
            try:
                Trainer(_config(layout), pc, stream=io.StringIO()).train(records.append)
            finally:
                dist.barrier()
                pc.destroy()
            out.append(records[-1]["layer_stats"])
    return out


@pytest.fixture(scope="module")
def one_process() -> dict:
    """Steps 1-3 of one process, profiled; the parameters around the detail step."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    pc = ParallelContext(dp=1, tp=1, pp=1)
    try:
        t = Trainer(_config({"dp": 1, "tp": 1, "pp": 1}), pc, stream=io.StringIO())
        first, _ = _events(t.train_step)
        before = {n: p.detach().clone() for n, p in t.named_params}
        _, out = _events(t.train_step)  # the detail step
        after = {n: p.detach().clone() for n, p in t.named_params}
        record = t.step_record(out, 1.0)
        third, _ = _events(t.train_step)
        hooks = sum(len(m._forward_hooks) for m in t.state.model.modules())
        norm_views = len(t.norm_views)
        t.close()
    finally:
        pc.destroy()
    return {"first": first, "third": third, "hooks": hooks, "record": record,
            "before": before, "after": after, "norm_views": norm_views}  # fmt: skip


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


def test_steps_without_statistics_have_no_host_sync_and_no_hook(one_process):
    for step in ("first", "third"):  # before and after the detail step
        events = one_process[step]
        assert {op: events.get(op, 0) for op in SYNC_OPS} == dict.fromkeys(SYNC_OPS, 0), step
        # the step's only norms are the gradient norm's views: no statistics computed
        assert events.get("aten::linalg_vector_norm", 0) == one_process["norm_views"], step
    assert one_process["hooks"] == 0


def test_every_layout_gives_one_process_statistics(one_process):
    want = one_process["record"]["layer_stats"]
    got = run_distributed(layout_stats, 2, LAYOUTS, timeout=300)[0]
    for layout, stats in zip(LAYOUTS, got, strict=True):
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
