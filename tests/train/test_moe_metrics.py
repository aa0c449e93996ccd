"""Expert load metrics (reporting/moe_metrics.py): the packing's weights count each token once,
the record's values, the step line, and the dashboard message."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from nanotron_train.reporting.metrics import MetricsLogger
from nanotron_train.reporting.moe_metrics import MoEMetrics, imbalance_of, moe_load_message
from nanotron_train.reporting.step_line import format_line


def stand_in(load, aux, z, micro_batches):
    """A module with a MoE block's `stats` (the models package's contract)."""
    stats = SimpleNamespace(
        load=torch.tensor(load, dtype=torch.float32),
        aux_loss=torch.tensor(aux),
        z_loss=torch.tensor(z),
        micro_batches=micro_batches,
    )
    return SimpleNamespace(stats=stats)


def pc_at(tp_rank=0, cp_rank=0):
    return SimpleNamespace(
        tp_rank=tp_rank, cp_rank=cp_rank, world_size=1, device=torch.device("cpu")
    )


BLOCKS = [(1, stand_in([6, 2, 0, 0], 0.5, 0.25, 2)), (3, stand_in([2, 2, 2, 2], 0.2, 0.1, 2))]


def test_one_rank_values():
    m = MoEMetrics(
        BLOCKS, num_layers=4, num_experts=4, pc=pc_at(), sequence_parallel=False, z_loss=True
    )
    rec = m.collect()
    assert rec["moe_load"] == {"1": [6, 2, 0, 0], "3": [2, 2, 2, 2]}
    assert rec["moe/layer_1/load_imbalance"] == 3.0  # 6 / mean 2
    assert rec["moe/layer_3/load_imbalance"] == 1.0
    assert rec["moe/load_imbalance"] == 3.0  # the worst layer
    # aux and z: the mean over micro-batches (2 each), then over layers
    assert rec["moe/layer_1/aux_loss"] == pytest.approx(0.25)
    assert rec["moe/aux_loss"] == pytest.approx((0.25 + 0.1) / 2)
    assert rec["moe/z_loss"] == pytest.approx((0.125 + 0.05) / 2)
    m.z_loss = False
    assert "moe/z_loss" not in m.collect()


def test_weights_count_each_token_once():
    """Summing packed tables over ranks: a tp replica under ALL_REDUCE adds no load and no
    loss; under sequence parallel its load (its own tokens) counts, its loss does not (the
    block already reduced it over tp); a cp rank > 0 adds load, not loss; a pp stage without
    the layer adds zeros."""
    packed = lambda pc, sp, blocks=BLOCKS: MoEMetrics(  # noqa: E731
        blocks, 4, 4, pc, sequence_parallel=sp, z_loss=True
    )._packed()
    mine = packed(pc_at(), False)
    assert torch.equal(packed(pc_at(tp_rank=1), False), torch.zeros(4, 7, dtype=torch.float64))
    sp = packed(pc_at(tp_rank=1), True)
    assert torch.equal(sp[:, :4], mine[:, :4]) and not sp[:, 4:].any()
    cp = packed(pc_at(cp_rank=1), False)
    assert torch.equal(cp[:, :4], mine[:, :4]) and not cp[:, 4:].any()
    assert not packed(pc_at(), False, blocks=[])[:, :].any()  # another pp stage
    # two dp replicas' tables summed: loads add, aux is the mean over 4 micro-batches
    other = MoEMetrics([(1, stand_in([0, 0, 4, 4], 0.3, 0.0, 2))], 4, 4, pc_at(), False, True)
    total = mine + other._packed()
    rec = other.values(total)
    assert rec["moe_load"]["1"] == [6, 2, 4, 4]
    assert rec["moe/layer_1/aux_loss"] == pytest.approx(0.8 / 4)
    assert rec["moe/layer_1/load_imbalance"] == pytest.approx(6 / 4)


def test_imbalance_of_empty_layer_is_nan():
    assert math.isnan(imbalance_of(torch.zeros(4)))


def test_step_line_and_sinks(tmp_path):
    rec = {
        "step": 3, "consumed_tokens": 10, "time_per_iteration_ms": 1.0, "tokens_per_sec": 1.0,
        "tokens_per_sec_per_gpu": 1.0, "global_batch_size": 2, "lm_loss": 2.0, "lr": 1e-3,
        "model_tflops_per_gpu": 0.0, "grad_norm": 1.0, "mfu": None, "memory": 0,
        "moe/aux_loss": 0.0123, "moe/load_imbalance": 1.5, "moe_load": {"1": [3, 1]},
    }  # fmt: skip
    line = format_line(rec, 10)
    assert "moe_aux_loss: 0.0123" in line and "moe_load_imbalance: 1.5" in line
    assert "moe_z_loss" not in line
    sent = []
    logger = MetricsLogger(str(tmp_path / "m.jsonl"), stream=None)
    logger._dashboard = SimpleNamespace(
        metrics=lambda step, r: sent.append(("metrics", step)),
        telemetry=lambda msg: sent.append(("telemetry", msg)),
    )
    logger.log(rec)
    logger._dashboard = None
    logger.close()
    assert json.loads((tmp_path / "m.jsonl").read_text())["moe_load"] == {"1": [3, 1]}
    msg = sent[1][1]
    assert sent[0] == ("metrics", 3) and msg["type"] == "moe_load" and msg["step"] == 3
    assert msg["layers"] == [{"layer": 1, "counts": [3, 1]}]
    assert moe_load_message(3, 0.0, {})["layers"] == []
