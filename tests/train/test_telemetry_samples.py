"""Samples at checkpoints: rank 0's replica (its tp group of 2 trained sequence-parallel; its
2 interleaved pipeline stages of tp 2; its 2 context-parallel ranks; dp rank 0 of 2 under
ZeRO-3) continues fixed prompts, the dashboard gets them, they equal what `nanotron_train.generate` decodes from the same
checkpoint, and training is bitwise the same as without them (losses, weights, RNG)."""

from __future__ import annotations

import copy
import io
import json
import os
from pathlib import Path

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.telemetry_helpers import FakeIngest
from tests.train.test_checkpoint import tiny_config

PROMPTS = ["the quick", "données 数据 and"]
MAX_NEW, STEPS = 6, 4


def _run(raw: dict) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    par = raw["parallelism"]
    pc = ParallelContext(par["dp"], par["tp"], par["pp"], cp=par.get("context_parallel_size", 1))
    try:
        trainer = Trainer(config_from_dict(copy.deepcopy(raw)), pc, stream=io.StringIO())
        records: list[dict] = []
        trainer.train(on_record=records.append, every_step=True)
        with trainer.grads.full_parameters():  # ZeRO-3: gathered over dp (collective)
            weights = [p.detach().clone() for p in trainer.state.model.parameters()]
        return [r["lm_loss"] for r in records], weights, torch.get_rng_state()
    finally:
        pc.destroy()


def _on_rank(raw: dict, off_dir: str, url: str) -> bool:
    torch.set_num_threads(1)
    plain = copy.deepcopy(raw)  # the same run without samples (its own checkpoints)
    plain["logging"]["sample_prompts"] = []
    plain["checkpoints"]["checkpoints_path"] = off_dir
    with shared_default_group():
        off = _run(plain)
        os.environ["NANOTRON_DASHBOARD_URL"] = url
        try:
            on = _run(raw)
        finally:
            del os.environ["NANOTRON_DASHBOARD_URL"]
    assert on[0] == off[0] and len(on[0]) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(on[1], off[1], strict=True))
    assert torch.equal(on[2], off[2])  # the RNG did not move
    return True


LAYOUTS = {  # section -> keys set on the tiny config
    # sequence parallel + async linears: decoding switches to ALL_REDUCE and back
    "tp2-sp": {
        "parallelism": {"tp": 2, "tp_mode": "REDUCE_SCATTER", "tp_linear_async_communication": True}
    },
    # world 4: 4 virtual stages over 2 pp ranks (the hidden state goes 0 -> 1 -> 0 -> 1 each
    # step), each stage split over tp = 2 and trained sequence-parallel
    "pp2-interleaved-tp2": {
        "parallelism": {
            "pp": 2,
            "pp_engine": "interleaved-1f1b",
            "pp_virtual_stages": 2,
            "tp": 2,
            "tp_mode": "REDUCE_SCATTER",
        }
    },
    # context parallel is switched off while both cp ranks decode whole sequences
    "cp2": {"parallelism": {"context_parallel_size": 2}},
    # both dp ranks gather the ZeRO-3 shards, dp rank 0 decodes alone
    "zero3-dp2": {"parallelism": {"dp": 2}, "optimizer": {"zero_stage": 3}},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_samples_at_checkpoints_leave_training_bitwise_unchanged(tmp_path, layout):
    from nanotron_train.data.testing import make_tokenizer, tiny_texts
    from nanotron_train.generate import main as generate_main

    tok = make_tokenizer(tmp_path / "tok", tiny_texts(60), vocab_size=300)
    raw = tiny_config({"dp": 1, "tp": 1, "pp": 1}, str(tmp_path / "ck"), steps=STEPS)
    raw["model"]["model_config"].update(vocab_size=300, num_hidden_layers=4)
    for section, values in LAYOUTS[layout].items():
        raw[section].update(values)
    raw["tokenizer"] = {"tokenizer_name_or_path": str(tok)}
    raw["checkpoints"]["checkpoint_interval"] = 2
    raw["logging"].update(sample_prompts=PROMPTS, sample_max_new_tokens=MAX_NEW)
    ingest = FakeIngest()
    try:
        off_dir = str(tmp_path / "ck-off")
        par = raw["parallelism"]
        world = par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)
        assert run_distributed(_on_rank, world, raw, off_dir, ingest.url) == [True] * world
    finally:
        ingest.close()
    assert ingest.refused() == []  # the real dashboard accepts every message
    sent = ingest.of_type("samples")
    assert [m["step"] for m in sent] == [2, 4]
    for m in sent:
        assert m["max_new_tokens"] == MAX_NEW
        assert [s["prompt"] for s in m["samples"]] == PROMPTS
    # the same continuations as the generate command on the step-4 checkpoint
    out = tmp_path / "gen.json"
    cmd = ["--ckpt-path", str(tmp_path / "ck" / "4"), "--max-new-tokens", str(MAX_NEW)]
    cmd += [a for p in PROMPTS for a in ("--prompt", p)]
    assert generate_main([*cmd, "--output-json", str(out)]) == 0
    report = json.loads(Path(out).read_text())
    want = [r["continuation"] for r in report["results"]]
    assert [s["completion"] for s in sent[1]["samples"]] == want
    assert any(want)  # something was generated
