"""Nanotron's Qwen2 examples here: config_qwen.yaml loads unchanged and trains with only its
sizes, layout and paths changed (the MoE example: test_moe_model.py); and
Qwen2 with document masking, a sliding window and NoPE layers trains the same model at
tp=2 x pp=2 (1f1b) and at dp=2 ZeRO-3 x tp=2 with recompute as in one process (1e-5), and at
cp=2 (each cp attention) its packed loss is the token-weighted loss of each document alone."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_parallel.testing import run_distributed, shared_default_group
from nanotron_train.config import config_from_dict, load_config

HERE = Path(__file__).parent / "nanotron"
QWEN = HERE / "config_qwen.yaml"
STEPS = 4
SIZES = dict(  # the only model keys the tests change
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
)


@pytest.fixture(autouse=True)
def _default_group_per_test():
    with shared_default_group():
        yield


def test_config_qwen_loads_unchanged_with_nanotron_meanings():
    cfg = load_config(QWEN, world_size=4)
    mc = cfg.model.model_config
    assert type(mc).__name__ == "Qwen2Config"
    assert (mc.hidden_size, mc.num_hidden_layers, mc.num_key_value_heads) == (2048, 36, 4)
    assert mc.document_masking and mc.tie_word_embeddings and not mc.attention_bias
    assert [mc.uses_rope(i) for i in range(4)] == [True] * 4 and mc.sliding_window(0) is None
    assert mc.attention_backend == "flash_attn" and mc.z_loss_weight == 0.0
    raw = yaml.safe_load(QWEN.read_text())["model"]["model_config"]
    assert {k: getattr(mc, k) for k in raw} == raw  # every key reached the config as given
    par = cfg.parallelism
    assert (par.dp, par.tp, par.tp_mode, par.tp_recompute_allgather) == (
        2,
        2,
        "REDUCE_SCATTER",
        True,
    )


def _sized(data: dict) -> dict:
    data["model"]["model_config"].update(SIZES)
    data["tokens"].update(sequence_length=64, micro_batch_size=2, train_steps=STEPS)
    data["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = STEPS - 2
    return data


def test_config_qwen_trains_with_sizes_layout_and_paths_changed(tmp_path, monkeypatch):
    """Its Nanoset stage points at a local folder, its layout folds onto one process: it trains
    (document masking on the Nanoset's documents), its loss falls and it checkpoints."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.data.testing import make_id_nanoset
    from nanotron_train.trainer import train

    monkeypatch.chdir(tmp_path)
    data = _sized(yaml.safe_load(QWEN.read_text()))
    folder = make_id_nanoset(tmp_path / "ns", [20, 45, 9, 70] * 10, high=8, seed=1)
    data["data_stages"][0]["data"]["dataset"]["dataset_folder"] = [str(folder)]
    dataset = data["data_stages"][0]["data"]["dataset"]
    dataset.update(tokenizer_name=None, vocab_size=256, token_size_in_bytes=2)  # our folder
    data["tokenizer"]["tokenizer_name_or_path"] = None
    data["parallelism"].update(dp=1, tp=1)
    val = make_id_nanoset(tmp_path / "val", [30, 50] * 4, high=8, seed=2)
    data["validation"] = {"dataset": {"dataset_folder": [str(val)]}}  # evaluated with the mask
    data["tokens"]["val_check_interval"] = STEPS
    cfg = config_from_dict(data, "q.yaml", world_size=1)
    records: list[dict] = []
    train(cfg, ParallelContext(1, 1, 1), stream=io.StringIO(), on_record=records.append)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["lm_loss"] == pytest.approx(math.log(256), abs=0.1)
    assert records[-1]["lm_loss"] < records[0]["lm_loss"]
    assert (tmp_path / "checkpoints" / str(STEPS)).is_dir()
    assert math.log(8) - 1 < records[-1]["val_loss"] < records[0]["lm_loss"]


def masked_config(layout: dict) -> dict:
    """Qwen2 with document masking, a window of 6 and every 2nd layer NoPE, on synthetic packed
    documents (2 layers, seq 32, global batch 4, 3 steps, fp32)."""
    data = _sized(yaml.safe_load(QWEN.read_text()))
    data["model"]["model_config"].update(
        sliding_window_size=6,
        no_rope_layer=2,
        _attn_implementation="sdpa",
        attention_bias=True,
    )
    data["model"]["model_config"]["num_hidden_layers"] = 2  # layer 0 windowed, layer 1 NoPE
    data["model"]["dtype"] = "float32"
    data["tokens"].update(sequence_length=32, batch_accumulation_per_replica=2 // layout["dp"])
    data["tokens"]["train_steps"] = 3
    data["data_stages"][0]["data"]["dataset"] = None
    data["checkpoints"]["checkpoints_path"] = None
    data["general"]["ignore_sanity_checks"] = True
    par = data["parallelism"]
    par.update(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], pp_engine="1f1b")
    par.update(tp_mode=layout["mode"], tp_linear_async_communication=False)
    par["recompute_layer"] = layout.get("recompute", False)
    data["optimizer"]["zero_stage"] = layout.get("zero", 0)
    data["optimizer"]["optimizer_factory"]["torch_adam_is_fused"] = False
    return data


def run_masked(layouts: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    with shared_default_group():
        return _train(layouts)


def _train(layouts: list[dict]) -> list[dict]:
    """Each layout's lm_loss and grad_norm curves (inside one shared default group)."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    out = []
    for layout in layouts:
        cfg = config_from_dict(masked_config(copy.deepcopy(layout)), "q", world_size=None)
        pc = ParallelContext(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"])
        try:
            records: list[dict] = []
            Trainer(cfg, pc, stream=io.StringIO()).train(on_record=records.append)
        finally:
            dist.barrier()
            pc.destroy()
        out.append(
            {"loss": [r["lm_loss"] for r in records], "norm": [r["grad_norm"] for r in records]}
        )
    return out


DOC_LENGTHS = [7, 3, 9, 13]  # 32 tokens: cp=2 cuts chunks of 8; the 3rd document crosses two


def cp_document_loss(choice: str) -> dict:
    """Runs on 4 ranks as dp=2 x cp=2: the packed loss of a row of documents, computed by a
    cp=2 Qwen2 (document masks, window, NoPE) and averaged over its cp ranks, against the
    token-weighted loss of each document run alone in one process; gradients likewise."""
    import torch.distributed as dist

    from nanotron_models import build_llama
    from nanotron_models.qwen2 import Qwen2Config
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.context_parallel import split_batch

    config = Qwen2Config(**SIZES, sliding_window_size=6, no_rope_layer=2, _use_doc_masking=True,
                         attention_bias=True, _attn_implementation="sdpa")  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (1, sum(DOC_LENGTHS) + 1), generator=gen)
    pos = torch.cat([torch.arange(n) for n in DOC_LENGTHS])[None]
    batch = {"input_ids": ids[:, :-1], "label_ids": ids[:, 1:], "position_ids": pos,
             "label_mask": torch.ones(1, pos.shape[1], dtype=torch.bool),
             "document_ids": (pos == 0).cumsum(dim=1)}  # fmt: skip
    pc = ParallelContext(dp=2, cp=2)
    try:
        alone = build_llama(config, pc, seed=4)  # one process's view: each document alone
        expected, start = 0.0, 0
        for n in DOC_LENGTHS:
            doc = {k: v[:, start : start + n] for k, v in batch.items() if k != "document_ids"}
            doc["position_ids"] = torch.arange(n)[None]
            loss = alone(None, doc) * n / pos.shape[1]
            loss.backward()
            expected += float(loss.detach())
            start += n
        model = build_llama(config, pc, seed=4)
        model.set_context_parallel(pc.cp_group, 2, attention=choice)
        loss = model(None, split_batch(batch, pc.cp_rank, 2))
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=pc.cp_group)
        worst = 0.0
        for p, q in zip(model.parameters(), alone.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad, group=pc.cp_group)
            worst = max(worst, float((grad / 2 - q.grad).abs().max() / q.grad.abs().max()))
        return {"packed": float(total) / 2, "alone": expected, "grad_rel": worst}
    finally:
        pc.destroy()


def run_masked_and_cp(layouts: list[dict]) -> dict:
    """One world-4 launch: the trainer layouts, then the cp=2 document loss per cp attention."""
    torch.set_num_threads(1)
    with shared_default_group():
        trained = _train(layouts)
        cp = {choice: cp_document_loss(choice) for choice in ("allgather", "ring", "ulysses")}
    return {"trained": trained, "cp": cp}


def test_masked_qwen2_layouts_equal_one_process():
    ref = run_masked([{"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE"}])[0]
    layouts = [
        {"dp": 1, "tp": 2, "pp": 2, "mode": "REDUCE_SCATTER"},
        {"dp": 2, "tp": 2, "pp": 1, "mode": "ALL_REDUCE", "zero": 3, "recompute": True},
    ]
    ranks = run_distributed(run_masked_and_cp, 4, layouts, timeout=300)
    results = ranks[0]["trained"]
    for rank in ranks:  # document masking by value at cp=2: every cp attention, every rank
        for choice, cp in rank["cp"].items():
            assert cp["packed"] == pytest.approx(cp["alone"], rel=1e-5), (choice, cp)
            assert cp["grad_rel"] < 1e-5, (choice, cp)
    assert len(ref["loss"]) == 3 and all(math.isfinite(x) for x in ref["loss"])
    for layout, res in zip(layouts, results, strict=True):
        for key in ("loss", "norm"):
            for a, b in zip(res[key], ref[key], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (layout, key, res[key], ref[key])


def test_masked_qwen2_step_has_no_host_sync():
    """Document masks, a window and NoPE layers add no host read to a training step (the
    positions' cos/sin come from the positions, the masks from the document ids on device)."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer
    from tests.train.test_step_syncs import SYNC_OPS, _events

    torch.set_num_threads(1)
    raw = masked_config({"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE"})
    raw["logging"]["iteration_step_info_interval"] = 1000  # a logged step reads its loss
    cfg = config_from_dict(raw, "q", world_size=None)
    pc = ParallelContext(1, 1, 1)
    try:
        trainer = Trainer(cfg, pc, stream=io.StringIO())
        trainer.train_step()
        step, _ = _events(trainer.train_step)
        trainer.close()
    finally:
        pc.destroy()
    assert {op: step.get(op, 0) for op in SYNC_OPS} == dict.fromkeys(SYNC_OPS, 0), step
