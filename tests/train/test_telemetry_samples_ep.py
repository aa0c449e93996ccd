"""Samples at checkpoints under expert parallelism: the ranks of dp rank 0's ep group decode
together (each holds half the experts; every MoE layer dispatches over both), and the samples
equal those of the same run at ep = 1 (the test-size Qwen2 MoE of test_moe_train.py, world 2)."""

from __future__ import annotations

import copy
import io
import os

import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.telemetry_helpers import FakeIngest
from tests.train.test_moe_train import moe_config

PROMPTS = ["the quick", "def f(x):"]
MAX_NEW, STEPS = 5, 2


def _train(raw: dict, url: str) -> None:
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    par = raw["parallelism"]
    pc = ParallelContext(par["dp"], par["tp"], par["pp"], ep=par["expert_parallel_size"])
    os.environ["NANOTRON_DASHBOARD_URL"] = url
    try:
        Trainer(config_from_dict(copy.deepcopy(raw)), pc, stream=io.StringIO()).train()
    finally:
        del os.environ["NANOTRON_DASHBOARD_URL"]
        pc.destroy()


def _on_rank(runs: list[tuple[dict, str]]) -> bool:
    torch.set_num_threads(1)
    with shared_default_group():
        for raw, url in runs:
            _train(raw, url)
    return True


def test_samples_at_expert_parallel_equal_those_at_ep1(tmp_path):
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    tok = make_tokenizer(tmp_path / "tok", tiny_texts(60), vocab_size=300)
    runs, ingests = [], []
    for ep in (1, 2):
        raw = moe_config({"dp": 2, "ep": ep, "save": str(tmp_path / f"ck{ep}")})
        raw["model"]["model_config"].update(vocab_size=300, bos_token_id=None, eos_token_id=None)
        raw["tokens"]["train_steps"] = STEPS
        raw["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = STEPS
        raw["tokenizer"] = {"tokenizer_name_or_path": str(tok)}
        raw["logging"].update(sample_prompts=PROMPTS, sample_max_new_tokens=MAX_NEW)
        ingests.append(FakeIngest())
        runs.append((raw, ingests[-1].url))
    try:
        assert run_distributed(_on_rank, 2, runs) == [True, True]
    finally:
        for ingest in ingests:
            ingest.close()
    at_ep1, at_ep2 = (ingest.of_type("samples") for ingest in ingests)
    assert [m["step"] for m in at_ep2] == [2] and [m["step"] for m in at_ep1] == [2]
    assert [s["prompt"] for s in at_ep2[0]["samples"]] == PROMPTS
    assert at_ep2[0]["samples"] == at_ep1[0]["samples"]
    assert any(s["completion"] for s in at_ep2[0]["samples"])  # something was decoded
