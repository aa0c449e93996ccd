"""Nanotron's keys change what a run trains: model and optimizer keys reach what is built,
Nanotron's example YAML trains and checkpoints as it says, z-loss (also vocab-parallel),
data stages with their own sources and sequence lengths, loading workers, the initial
state, the recorded step and the benchmark CSV."""

from __future__ import annotations

import io
import math

import pytest
import torch
import yaml

from nanotron_parallel.testing import shared_default_group
from nanotron_train.config import config_from_dict
from tests.train.nanotron_compat_helpers import (
    example,
    make_trainer,
    one_step,
    stages_config,
    tiny_config,
    train_records,
)


@pytest.fixture(autouse=True)
def _default_group_per_test():
    """The trainers made here share one default group that is destroyed after each test, so no
    later test in the same process finds a group it did not make."""
    with shared_default_group():
        yield


def test_model_keys_reach_the_model_and_optimizer():
    """attention_bias, scaling_method, weight decay exclusions and sgd change what is built."""
    base = make_trainer(tiny_config())
    params = dict(base.state.model.named_parameters())
    assert "decoder.0.attn.qkv.bias" not in params
    o_std = float(params["decoder.0.attn.o_proj.weight"].detach().std())
    qkv_std = float(params["decoder.0.attn.qkv.weight"].detach().std())
    assert o_std == pytest.approx(0.02 / math.sqrt(4), rel=0.15)  # NUM_LAYERS: std / sqrt(2L)
    assert qkv_std == pytest.approx(0.02, rel=0.15)
    assert all(p.decay for p in base.state.optimizer.pieces)  # Nanotron: decay everything
    base.close()

    data = tiny_config(attention_bias=True)
    data["model"]["init_method"] = {"std": 0.02, "scaling_method": "none"}
    data["optimizer"]["weight_decay_exclude_named_params"] = [r".*\.bias$", ".*layernorm.*"]
    data["optimizer"]["optimizer_factory"] = {"name": "SGD"}
    tr = make_trainer(data)
    params = dict(tr.state.model.named_parameters())
    assert params["decoder.1.attn.qkv.bias"].shape == (32 + 2 * 16,)
    # Nanotron initialises biases to zeros
    assert float(params["decoder.1.attn.o_proj.bias"].detach().abs().sum()) == 0.0
    assert float(params["decoder.0.attn.o_proj.weight"].detach().std()) == pytest.approx(
        0.02, rel=0.15
    )
    no_decay = sorted(p.name for p in tr.state.optimizer.pieces if not p.decay)
    assert no_decay == sorted(
        n for n in params if n.endswith(".bias") or "norm" in n and "final" not in n
    )  # final_norm is Nanotron's final_layer_norm.pp_block.weight: no "layernorm" in it
    assert isinstance(tr.state.optimizer.inner, torch.optim.SGD)
    before = params["decoder.0.attn.qkv.bias"].detach().clone()
    rec = one_step(tr)
    after = params["decoder.0.attn.qkv.bias"].detach()
    assert math.isfinite(rec["lm_loss"]) and not torch.equal(before, after)  # biases train
    tr.close()


def test_example_runs_with_only_its_data_and_layout_changed(tmp_path, monkeypatch):
    """Nanotron's example, its two data stages pointed at local tokenized folders (ours, then
    a datatrove one) and its
    2x2x2 layout folded onto one process: it trains and checkpoints as the YAML says."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.data.testing import make_id_nanoset
    from nanotron_train.trainer import train
    from tests.train.datatrove_writer import documents, write_datatrove

    monkeypatch.chdir(tmp_path)
    data = example()
    ours = make_id_nanoset(tmp_path / "ns", [300] * 40, high=256)
    theirs = write_datatrove(tmp_path / "dt", [documents(1, 300), documents(2, 300)])
    for stage, folder in zip(data["data_stages"], (ours, theirs)):  # annealing on Nanotron data
        stage["data"]["dataset"] = {"dataset_folder": str(folder)}
    data["parallelism"].update(dp=1, tp=1, pp=1)
    cfg = config_from_dict(data, "ex.yaml", world_size=1)
    records: list[dict] = []
    train(cfg, ParallelContext(1, 1, 1), stream=io.StringIO(), on_record=records.append)
    assert [r["step"] for r in records] == list(range(1, 16))
    assert records[0]["lm_loss"] == pytest.approx(math.log(256), abs=0.05)  # std 0.025: ~uniform
    assert records[-1]["lm_loss"] < records[0]["lm_loss"]
    assert records[0]["lr"] == pytest.approx(3e-4 / 2)  # linear warm-up over 2 steps
    assert records[-1]["lr"] == pytest.approx(1e-5)  # cosine down to min_decay_lr at 2 + 13
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "10",
        "15",
        "latest.txt",
    ]


def _z_config(z: bool, tp: int = 1) -> dict:
    data = tiny_config(z_loss_enabled=z, z_loss_coefficient=0.01)
    data["parallelism"] = {"dp": 1, "tp": tp, "pp": 1, "tp_mode": "REDUCE_SCATTER"}
    data["model"]["model_config"]["vocab_size"] = 63  # padded to 64 at tp=2: masked columns
    return data


def _z_records(tp: int) -> list[dict]:
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.trainer import train

    torch.set_num_threads(1)
    with shared_default_group():
        pc = ParallelContext(1, tp, 1)
        try:
            records: list[dict] = []
            cfg = config_from_dict(_z_config(True, tp))
            train(cfg, pc, stream=io.StringIO(), on_record=records.append)
            return records
        finally:
            pc.destroy()


def test_z_loss_is_added_logged_and_vocab_parallel():
    """z_loss = coef * mean(logsumexp(logits)^2) is logged and included in lm_loss; at tp=2
    (vocab-sharded, with vocab padding) the losses equal one process's."""
    from nanotron_parallel.testing import run_distributed

    off, on = make_trainer(_z_config(False)), make_trainer(_z_config(True))
    position = on.state.data.state_dict()
    batch = on.state.data.micro_batches(1)[0]
    on.state.data.load_state_dict(position)  # train_step reads the same batch again
    logits = on.state.model.logits(batch["input_ids"]).double()
    expected_z = 0.01 * float((torch.logsumexp(logits, -1) ** 2).mean())
    rec_off, rec_on = one_step(off), one_step(on)
    on.close(), off.close()  # last built first: each restores the signal handlers it found
    assert "z_loss" not in rec_off
    assert rec_on["z_loss"] == pytest.approx(expected_z, rel=1e-5)
    assert rec_on["lm_loss"] - rec_off["lm_loss"] == pytest.approx(expected_z, rel=1e-4)
    one = _z_records(1)
    two = run_distributed(_z_records, 2, 2, timeout=120)[0]
    for a, b in zip(one, two, strict=True):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["z_loss"] == pytest.approx(a["z_loss"], rel=1e-5)
    assert one[-1]["z_loss"] != one[0]["z_loss"]  # it trains (the gradient reaches the model)


def test_synthetic_and_real_stages_mix_with_their_own_sequence_lengths(tmp_path):
    """Stages switch source and sample length at their start step; a resume inside the run
    continues exactly (each stage's source keeps its position)."""
    from nanotron_train.data.synthetic import synthetic_sample
    from nanotron_train.data.testing import make_id_nanoset

    nanoset = make_id_nanoset(tmp_path / "ns", [50] * 20, low=1, high=60, vocab_size=64)
    tr = make_trainer(stages_config(tmp_path, nanoset, 6))
    data, mbs = tr.state.data, 2
    seen = [data.micro_batches(step)[0]["input_ids"] for step in range(1, 7)]
    assert [tuple(x.shape) for x in seen] == [(mbs, 16)] * 2 + [(mbs, 8)] * 2 + [(mbs, 16)] * 2
    assert torch.equal(seen[0][0], synthetic_sample(0, 1, 17, 64)[:-1])  # stage "warm"
    assert torch.equal(seen[4][0], synthetic_sample(0, 9, 17, 64)[:-1])  # synth2: own seed, from 0
    tokens = set(torch.cat([seen[2], seen[3]]).flatten().tolist())
    assert tokens <= set(range(0, 60)) and len(tokens) > 20  # the nanoset's ids
    tr.close()
    full = train_records(make_trainer(stages_config(tmp_path, nanoset, 6)))
    assert [r["consumed_tokens"] for r in full] == [32, 64, 80, 96, 128, 160]  # 2 seqs x length
    half = stages_config(tmp_path / "b", nanoset, 4)
    train_records(make_trainer(half))
    resumed = train_records(make_trainer(stages_config(tmp_path / "b", nanoset, 6, resume=True)))
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in full[4:]]


def test_initial_state_recorded_step_and_benchmark_csv(tmp_path):
    """save_initial_state writes step 0 (resuming from it reproduces the run); a checkpoint's
    config records general.step/consumed_train_samples, checked on resume; benchmark_csv_path
    gets one row per run."""
    data = tiny_config()
    data["checkpoints"] = {"checkpoints_path": str(tmp_path / "ck"), "checkpoint_interval": 2,
                           "save_initial_state": True}  # fmt: skip
    data["general"]["benchmark_csv_path"] = str(tmp_path / "bench" / "runs.csv")
    full = train_records(make_trainer(data))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["0", "2", "3", "latest.txt"]
    saved = yaml.safe_load((tmp_path / "ck" / "2" / "config.yaml").read_text())
    assert (saved["general"]["step"], saved["general"]["consumed_train_samples"]) == (2, 4)
    resumed_cfg = tiny_config()
    resumed_cfg["checkpoints"] = {"resume_checkpoint_path": str(tmp_path / "ck" / "0")}
    again = train_records(make_trainer(resumed_cfg))
    assert [r["lm_loss"] for r in again] == [r["lm_loss"] for r in full]
    saved["checkpoints"]["resume_checkpoint_path"] = str(tmp_path / "ck" / "3")  # step 2's config
    saved["general"]["benchmark_csv_path"] = None
    with pytest.raises(ValueError, match="general.step: the config says 2 but .* is at 3"):
        make_trainer(saved)
    import csv

    rows = list(csv.DictReader((tmp_path / "bench" / "runs.csv").open()))
    train_records(make_trainer(data | {"checkpoints": {}}))
    rows2 = list(csv.DictReader((tmp_path / "bench" / "runs.csv").open()))
    assert len(rows) == 1 and len(rows2) == 2
    row = rows[0]
    assert (row["name"], row["seq_len"], row["gbs"], row["steps"], row["dtype"]) == (
        "r", "16", "2", "3", "float32")  # fmt: skip
    mean = sum(r["tokens_per_sec_per_gpu"] for r in full[1:]) / 2
    assert float(row["tok/s/gpu"]) == pytest.approx(mean, abs=0.01)


def test_num_loading_workers_prefetch_same_batches_and_position(tmp_path):
    """Prefetching (Nanotron's default: 1 worker) changes nothing but timing: the same losses
    as without, and a checkpoint taken while a step is prefetched resumes exactly."""
    from nanotron_train.data.testing import make_id_nanoset

    nanoset = make_id_nanoset(tmp_path / "ns", [50] * 20, low=1, high=60, vocab_size=64)
    runs = {}
    for workers in (0, 3):
        data = stages_config(tmp_path / f"w{workers}", nanoset, 6)
        for stage in data["data_stages"]:
            stage["data"]["num_loading_workers"] = workers
        tr = make_trainer(data)
        assert type(tr.state.data).__name__ == ("Prefetched" if workers else "StagedData")
        runs[workers] = [r["lm_loss"] for r in train_records(tr)]
    assert runs[0] == runs[3]
