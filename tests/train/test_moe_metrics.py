"""Expert load metrics (reporting/moe_metrics.py): the packing's weights count each token once,
the record's values, the step line, and the dashboard message."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from nanotron_train.reporting.dashboard_spool import moe_load_message
from nanotron_train.reporting.metrics import MetricsLogger
from nanotron_train.reporting.moe_metrics import MoEMetrics, imbalance_of
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
    assert rec["moe/layer_3/z_loss"] == pytest.approx(0.05)
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
    assert math.isnan(imbalance_of([0.0] * 4)) and imbalance_of([3.0, 1.0]) == 1.5


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
    logger._dashboard = SimpleNamespace(metrics=lambda step, r: sent.append((step, r)))
    logger.log(rec)
    logger._dashboard = None
    logger.close()
    assert json.loads((tmp_path / "m.jsonl").read_text())["moe_load"] == {"1": [3, 1]}
    # the client gets the loads with the record (it sends them, and replays them with it)
    assert sent == [(3, rec)]
    msg = moe_load_message(3, 0.0, rec["moe_load"])
    assert msg["type"] == "moe_load" and msg["step"] == 3
    assert msg["layers"] == [{"layer": 1, "counts": [3, 1]}]
    # what the dashboard accepts (its own model of the message)
    from nanotron_dashboard.messages import validate

    assert validate({**msg, "run_id": "r"}).layers[0].counts == [3, 1]
    assert moe_load_message(3, 0.0, {})["layers"] == []


QWEN_MOE = Path(__file__).parent / "nanotron" / "config_qwen_with_moe.yaml"


def tiny_moe(tmp_path) -> dict:
    """Nanotron's Qwen2 MoE example at test sizes: 4 experts, top-2, both layers MoE."""
    data = yaml.safe_load(QWEN_MOE.read_text())
    mc = data["model"]["model_config"]
    mc.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
              sliding_window_size=None, _attn_implementation="sdpa")  # fmt: skip
    mc["moe_config"].update(num_experts=4, top_k=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, router_z_loss_coef=1e-3)  # fmt: skip
    data["model"]["dtype"] = "float32"
    data["tokens"].update(sequence_length=32, micro_batch_size=2, train_steps=2)
    data["tokens"]["batch_accumulation_per_replica"] = 2
    data["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = 2
    data["optimizer"]["optimizer_factory"]["torch_adam_is_fused"] = False
    data["data_stages"][0]["data"]["dataset"] = None  # synthetic tokens
    data["checkpoints"]["checkpoints_path"] = None
    data["logging"].update(iteration_step_info_interval=1, metrics_file=str(tmp_path / "m.jsonl"))
    data["parallelism"].update(dp=1, tp=1, pp=1, pp_engine="1f1b")
    return data


def test_a_training_step_records_the_routers_counts(tmp_path):
    """One process, two steps of two micro-batches: each layer's logged counts are the
    bincount of its router's top-k choices, the imbalance their max / mean, the aux and z
    losses the balance formulas (HF Qwen2-MoE's) on the router's outputs, mean over the
    micro-batches; the metrics file, the step line and the dashboard message carry them."""
    from nanotron_models.moe.stats import moe_blocks
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    cfg = config_from_dict(tiny_moe(tmp_path), "moe.yaml", world_size=None)
    out = io.StringIO()
    trainer = Trainer(cfg, ParallelContext(1, 1, 1), stream=out)
    seen: dict[int, list] = {}

    def hook(layer):
        def keep(module, args, routing):
            if torch.is_grad_enabled():  # training forwards, not an evaluation
                seen.setdefault(layer, []).append(type(routing)(*(t.detach() for t in routing)))

        return keep

    blocks = moe_blocks(trainer.state.model)
    assert [layer for layer, _ in blocks] == [0, 1]
    for layer, block in blocks:
        block.router.register_forward_hook(hook(layer))
    records = []

    def check(rec):
        records.append(rec)
        for layer, routings in seen.items():
            counts = sum(torch.bincount(r.topk_idx.flatten(), minlength=4) for r in routings)
            assert rec["moe_load"][str(layer)] == counts.tolist()
            assert rec[f"moe/layer_{layer}/load_imbalance"] == pytest.approx(
                float(counts.max()) / float(counts.float().mean()), rel=1e-6
            )
            aux = [4 * (torch.bincount(r.topk_idx.flatten(), minlength=4) / len(r.probs)
                        * r.probs.mean(0)).sum() for r in routings]  # fmt: skip
            assert rec[f"moe/layer_{layer}/aux_loss"] == pytest.approx(
                float(sum(aux)) / 2, rel=1e-5
            )
            assert len(routings) == 2 and int(counts.sum()) == 2 * 2 * 32 * 2  # mb x b x s x k
        z = [float((torch.logsumexp(r.logits, -1) ** 2).mean()) for rs in seen.values() for r in rs]
        assert rec["moe/z_loss"] == pytest.approx(sum(z) / len(z), rel=1e-5)
        seen.clear()

    trainer.train(on_record=check)
    assert [r["step"] for r in records] == [1, 2]
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["moe_load"] for x in lines] == [r["moe_load"] for r in records]
    assert "moe_aux_loss: " in out.getvalue() and "moe_load_imbalance: " in out.getvalue()


def test_rank_stats_show_the_all_to_all_phase_and_name_an_unknown_one(caplog):
    """The all-to-all time is its own field, out of compute; a phase rank_stats has no field
    for is named in one warning (once) and stays in compute."""
    from nanotron_train.telemetry.rank_stats import FIELDS, local_row

    totals = {"step": 100.0, "pipeline": 80.0, "tp_comm": 10.0, "all_to_all": 30.0}
    row = dict(zip(FIELDS, local_row(totals, 2, torch.device("cpu"), {})))
    assert row["all_to_all_ms"] == 15.0 and row["compute_ms"] == 20.0  # (80 - 10 - 30) / 2
    with caplog.at_level("WARNING", logger="nanotron_train.telemetry"):
        local_row({**totals, "expert_sync": 4.0}, 2, torch.device("cpu"), {})
        local_row({**totals, "expert_sync": 4.0}, 2, torch.device("cpu"), {})
    said = [r.getMessage() for r in caplog.records if "expert_sync" in r.getMessage()]
    assert len(said) == 1 and "counted as compute" in said[0]
