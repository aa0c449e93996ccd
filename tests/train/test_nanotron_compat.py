"""A Nanotron user's config works here: every Nanotron key is implemented or refused in one
line, the table in docs/configuration.md says which and cannot drift, and Nanotron's own example YAML runs."""

from __future__ import annotations

import dataclasses
import datetime
import io
import math
import re
import types
import typing
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_parallel.testing import shared_default_group
from nanotron_train.config import Config, ConfigError, config_from_dict, expand_run_name

HERE = Path(__file__).parent / "nanotron"
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = HERE / "config_tiny_llama.yaml"
NANOTRON_KEYS = [k.strip() for k in (HERE / "nanotron_keys.txt").read_text().splitlines()]


@pytest.fixture(autouse=True)
def _default_group_per_test():
    """The trainers made here share one default group that is destroyed after each test, so no
    later test in the same process finds a group it did not make."""
    with shared_default_group():
        yield


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def readme_table() -> dict[str, str]:
    text = (REPO / "docs" / "configuration.md").read_text()
    block = text.split("<!-- nanotron-keys:start -->")[1].split("<!-- nanotron-keys:end -->")[0]
    return dict(re.findall(r"^\| `([^`]+)` \| (.+) \|$", block, flags=re.M))


def _field_type(cls: type, name: str) -> type | None:
    hints = typing.get_type_hints(cls)
    if name not in hints:
        return None
    tp = hints[name]
    while typing.get_origin(tp) in (typing.Union, types.UnionType, list):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = next((a for a in args if dataclasses.is_dataclass(a)), args[0])
    return tp


def resolves(key: str) -> bool:
    """The dotted Nanotron key is a field of our config dataclasses."""
    cls: type | None = Config
    for part in key.split("."):
        if cls is None or not dataclasses.is_dataclass(cls):
            return False
        if part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        cls = _field_type(cls, part)
    return True


def test_readme_table_lists_every_nanotron_key_and_each_is_a_field():
    table = readme_table()
    assert sorted(table) == sorted(NANOTRON_KEYS)
    assert [k for k in NANOTRON_KEYS if not resolves(k)] == []


# A value that asks for a feature we do not have, per key the keys table (docs/configuration.md) marks "refused".
REFUSALS = {
    "s3_upload": {"upload_s3_path": "s3://bucket/run", "remove_after_upload": True},
    "tokenizer.tokenizer_max_length": 2048,
    "data_stages.data.dataset.hf_dataset_config_name": "en",
    "data_stages.data.dataset.use_old_brrr_dataloader": True,
    "tokens.limit_test_batches": 2,
}


def _set(data: dict, key: str, value) -> str:
    """Set a Nanotron dotted key in the example config; returns the key as errors name it."""
    parts = key.split(".")
    if parts[0] == "data_stages":
        node, named = data["data_stages"][0], ["data_stages", "0"]
        parts = parts[1:]
    else:
        node, named = data, []
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        named.append(part)
    node[parts[-1]] = value
    return ".".join(named + [parts[-1]])


def test_each_refused_key_is_one_line_naming_it():
    table = readme_table()
    refused = sorted(k for k, v in table.items() if v.startswith("refused"))
    assert refused == sorted(REFUSALS)
    for key, bad in REFUSALS.items():
        data = example()
        named = _set(data, key, bad)
        with pytest.raises(ConfigError) as err:
            config_from_dict(data, "ex.yaml", world_size=8)
        assert str(err.value).startswith(f"ex.yaml: {named}: "), str(err.value)
        assert "\n" not in str(err.value)


def test_example_loads_unchanged_with_nanotron_meanings(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cfg = config_from_dict(example(), "ex.yaml", world_size=8)
    par = cfg.parallelism
    assert (par.dp, par.tp, par.pp, par.tp_mode, par.pp_engine) == (
        2,
        2,
        2,
        "REDUCE_SCATTER",
        "1f1b",
    )
    assert cfg.model.dtype == "bfloat16" and cfg.model.init_method.scaling_method == "NUM_LAYERS"
    assert cfg.model.model_config.attention_backend == "flash_attn"
    assert [s.sequence_length for s in cfg.data_stages] == [256, 256]
    assert cfg.data_stages[1].data.dataset.hf_dataset_splits == ["train"]
    assert cfg.optimizer.weight_decay_exclude_named_params == []
    flat = lambda d, p="": [  # noqa: E731
        (k2, v2) for k, v in d.items()
        for k2, v2 in (flat(v, f"{p}{k}.") if isinstance(v, dict) else [(f"{p}{k}", v)])
    ]  # fmt: skip
    ours = dict(flat(cfg.to_dict()))
    theirs = example()
    theirs["data_stages"] = {}  # lists: checked above
    for key, value in flat(theirs):  # every scalar key of the YAML reached the config as given
        if key != "general.run":
            assert ours[key] == (["train"] if key.endswith("splits") else value), key
    # Nanotron's defaults where a key is left out
    data = example()
    del data["model"]["dtype"], data["parallelism"]["pp_engine"]
    del data["optimizer"]["learning_rate_scheduler"]["lr_decay_style"]
    data["general"]["run"] = "r_%jobid_%date"
    cfg = config_from_dict(data, "ex.yaml", world_size=8)
    assert cfg.model.dtype == "bfloat16" and cfg.parallelism.pp_engine == "afab"
    assert cfg.optimizer.learning_rate_scheduler.lr_decay_style == "linear"
    assert re.fullmatch(r"r_4242_\d{8}_\d{6}", cfg.general.run)


def test_run_name_templates_and_case_insensitive_enums(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    when = datetime.datetime(2026, 4, 7, 15, 25, 9)
    assert expand_run_name(None, when) == "20260407_152509_local"
    assert expand_run_name("a_%date", when) == "a_20260407_152509"
    data = example()
    data["parallelism"].update(tp_mode="reduce_scatter", pp_engine="AFAB")
    data["optimizer"]["optimizer_factory"]["name"] = "AdamW"
    cfg = config_from_dict(data, "ex.yaml", world_size=8)
    assert (cfg.parallelism.tp_mode, cfg.parallelism.pp_engine) == ("REDUCE_SCATTER", "afab")
    assert cfg.optimizer.optimizer_factory.name == "adamW"


def test_weight_decay_exclusions_match_ours_or_nanotrons_names():
    from nanotron_train.interop.nanotron_names import (
        excluded_from_weight_decay,
        from_nanotron,
        to_nanotron,
    )

    nt = "model.decoder.3.pp_block.post_attention_layernorm.weight"
    assert to_nanotron("decoder.3.post_attn_norm.weight") == nt
    assert from_nanotron(nt) == "decoder.3.post_attn_norm.weight"
    assert to_nanotron("chunks.1.decoder.3.mlp.down.weight").endswith(
        "3.pp_block.mlp.down_proj.weight"
    )
    assert not excluded_from_weight_decay("decoder.0.attn.qkv.weight", [])  # default: decay all
    assert excluded_from_weight_decay("decoder.0.input_norm.weight", [".*layernorm.*"])
    assert excluded_from_weight_decay("embedding.weight", ["model.token_position_embeddings"])
    assert not excluded_from_weight_decay("decoder.0.attn.qkv.weight", [".*layernorm.*", ".*bias"])


TINY = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32,
}  # fmt: skip


def tiny_config(**model_config) -> dict:
    return {
        "general": {"project": "t", "run": "r", "seed": 3},
        "model": {"model_config": {**TINY, **model_config}, "dtype": "float32"},
        "tokens": {"sequence_length": 16, "micro_batch_size": 2,
                   "batch_accumulation_per_replica": 1, "train_steps": 3},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-2}, "weight_decay": 0.5},
        "data_stages": [{"name": "s", "start_training_step": 1, "data": {"seed": 1}}],
    }  # fmt: skip


def _step(trainer) -> dict:
    """One training step and its metrics record (as a logged step makes it)."""
    return trainer.step_record(trainer.train_step(), 0.0)


def _records(trainer) -> list[dict]:
    """Train to the end; every logged step's record."""
    records: list[dict] = []
    trainer.train(on_record=records.append)
    return records


def _trainer(data: dict):
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    return Trainer(config_from_dict(data), ParallelContext(1, 1, 1), stream=io.StringIO())


def test_model_keys_reach_the_model_and_optimizer():
    """attention_bias, scaling_method, weight decay exclusions and sgd change what is built."""
    base = _trainer(tiny_config())
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
    tr = _trainer(data)
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
    rec = _step(tr)
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
    from tests.train.test_nanotron_data import documents, write_datatrove

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

    off, on = _trainer(_z_config(False)), _trainer(_z_config(True))
    position = on.state.data.state_dict()
    batch = on.state.data.micro_batches(1)[0]
    on.state.data.load_state_dict(position)  # train_step reads the same batch again
    logits = on.state.model.logits(batch["input_ids"]).double()
    expected_z = 0.01 * float((torch.logsumexp(logits, -1) ** 2).mean())
    rec_off, rec_on = _step(off), _step(on)
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


def _stages_config(tmp_path: Path, nanoset: Path, steps: int, resume: bool = False) -> dict:
    data = tiny_config()
    data["tokens"]["train_steps"] = steps
    data["data_stages"] = [
        {"name": "warm", "start_training_step": 1, "data": {"seed": 1}, "sequence_length": 16},
        {"name": "real", "start_training_step": 3, "sequence_length": 8,
         "data": {"seed": 2, "dataset": {"dataset_folder": str(nanoset)}}},
        {"name": "synth2", "start_training_step": 5, "data": {"seed": 9}},
    ]  # fmt: skip
    data["checkpoints"] = {
        "checkpoints_path": str(tmp_path / "ck"), "checkpoint_interval": 4,
        "resume_checkpoint_path": str(tmp_path / "ck") if resume else None,
    }  # fmt: skip
    return data


def test_synthetic_and_real_stages_mix_with_their_own_sequence_lengths(tmp_path):
    """Stages switch source and sample length at their start step; a resume inside the run
    continues exactly (each stage's source keeps its position)."""
    from nanotron_train.data.synthetic import synthetic_sample
    from nanotron_train.data.testing import make_id_nanoset

    nanoset = make_id_nanoset(tmp_path / "ns", [50] * 20, low=1, high=60, vocab_size=64)
    tr = _trainer(_stages_config(tmp_path, nanoset, 6))
    data, mbs = tr.state.data, 2
    seen = [data.micro_batches(step)[0]["input_ids"] for step in range(1, 7)]
    assert [tuple(x.shape) for x in seen] == [(mbs, 16)] * 2 + [(mbs, 8)] * 2 + [(mbs, 16)] * 2
    assert torch.equal(seen[0][0], synthetic_sample(0, 1, 17, 64)[:-1])  # stage "warm"
    assert torch.equal(seen[4][0], synthetic_sample(0, 9, 17, 64)[:-1])  # synth2: own seed, from 0
    tokens = set(torch.cat([seen[2], seen[3]]).flatten().tolist())
    assert tokens <= set(range(0, 60)) and len(tokens) > 20  # the nanoset's ids
    tr.close()
    full = _records(_trainer(_stages_config(tmp_path, nanoset, 6)))
    assert [r["consumed_tokens"] for r in full] == [32, 64, 80, 96, 128, 160]  # 2 seqs x length
    half = _stages_config(tmp_path / "b", nanoset, 4)
    _records(_trainer(half))
    resumed = _records(_trainer(_stages_config(tmp_path / "b", nanoset, 6, resume=True)))
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in full[4:]]


def test_initial_state_recorded_step_and_benchmark_csv(tmp_path):
    """save_initial_state writes step 0 (resuming from it reproduces the run); a checkpoint's
    config records general.step/consumed_train_samples, checked on resume; benchmark_csv_path
    gets one row per run."""
    data = tiny_config()
    data["checkpoints"] = {"checkpoints_path": str(tmp_path / "ck"), "checkpoint_interval": 2,
                           "save_initial_state": True}  # fmt: skip
    data["general"]["benchmark_csv_path"] = str(tmp_path / "bench" / "runs.csv")
    full = _records(_trainer(data))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["0", "2", "3", "latest.txt"]
    saved = yaml.safe_load((tmp_path / "ck" / "2" / "config.yaml").read_text())
    assert (saved["general"]["step"], saved["general"]["consumed_train_samples"]) == (2, 4)
    resumed_cfg = tiny_config()
    resumed_cfg["checkpoints"] = {"resume_checkpoint_path": str(tmp_path / "ck" / "0")}
    again = _records(_trainer(resumed_cfg))
    assert [r["lm_loss"] for r in again] == [r["lm_loss"] for r in full]
    saved["checkpoints"]["resume_checkpoint_path"] = str(tmp_path / "ck" / "3")  # step 2's config
    saved["general"]["benchmark_csv_path"] = None
    with pytest.raises(ValueError, match="general.step: the config says 2 but .* is at 3"):
        _trainer(saved)
    import csv

    rows = list(csv.DictReader((tmp_path / "bench" / "runs.csv").open()))
    _records(_trainer(data | {"checkpoints": {}}))
    rows2 = list(csv.DictReader((tmp_path / "bench" / "runs.csv").open()))
    assert len(rows) == 1 and len(rows2) == 2
    row = rows[0]
    assert (row["name"], row["seq_len"], row["gbs"], row["steps"], row["dtype"]) == (
        "r", "16", "2", "3", "float32")  # fmt: skip
    mean = sum(r["tokens_per_sec_per_gpu"] for r in full[1:]) / 2
    assert float(row["tok/s/gpu"]) == pytest.approx(mean, abs=0.01)


def test_log_levels_per_rank(tmp_path, capfd):
    from nanotron_train.config.schema import LoggingArgs
    from nanotron_train.reporting.log_levels import configure_logging

    data = tiny_config()
    data["logging"] = {"log_level": "warning", "metrics_file": str(tmp_path / "m.jsonl")}
    out = io.StringIO()
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    _records(Trainer(config_from_dict(data), ParallelContext(1, 1, 1), stream=out))
    assert out.getvalue() == ""  # step lines are info
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3
    data["logging"]["log_level"] = "info"
    _records(Trainer(config_from_dict(data), ParallelContext(1, 1, 1), stream=out))
    assert out.getvalue().count("iteration: ") == 3
    import logging

    args = LoggingArgs(log_level="debug", log_level_replica="error")
    try:
        assert configure_logging(args, rank=1) == "error"
        assert logging.getLogger("nanotron_train").level == logging.ERROR
        logging.getLogger("nanotron_train.data").warning("hidden")
        assert configure_logging(args, rank=0) == "debug"
        logging.getLogger("nanotron_models.x").debug("shown")
        err = capfd.readouterr().err
        assert "[rank 0] DEBUG nanotron_models.x: shown" in err and "hidden" not in err
        assert configure_logging(LoggingArgs(log_level="passive"), rank=0) == "passive"
        assert logging.getLogger("nanotron_train").level == logging.DEBUG  # left alone
    finally:
        configure_logging(LoggingArgs(), rank=0)  # the default (info) for later tests


def test_tokenizer_revision_picks_that_snapshot_of_the_local_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from nanotron_train.data import DataError, load_tokenizer
    from nanotron_train.data.source import tokenizer_path
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    repo = tmp_path / "hub" / "models--org--tok"
    revs = {"a" * 40: 300, "b" * 40: 320}
    for rev, vocab in revs.items():
        make_tokenizer(repo / "snapshots" / rev, tiny_texts(), vocab_size=vocab)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_tokenizer("org/tok").vocab_size == 300  # main
    assert load_tokenizer("org/tok", "b" * 40).vocab_size == 320
    data = tiny_config()
    data["tokenizer"] = {"tokenizer_name_or_path": "org/tok", "tokenizer_revision": "b" * 40}
    assert tokenizer_path(config_from_dict(data).tokenizer) == str(
        repo / "snapshots" / ("b" * 40) / "tokenizer.json"
    )
    with pytest.raises(DataError, match="at revision 'c+'"):
        load_tokenizer("org/tok", "c" * 40)
    with pytest.raises(DataError, match="applies to hub names only"):
        load_tokenizer(str(repo / "snapshots" / ("a" * 40)), "main")


def _sanity_run(tmp: str) -> tuple[int, str, list[str]]:
    import os

    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.fault.sanity import SanityCheckError
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    data = tiny_config()
    data["general"]["ignore_sanity_checks"] = False
    data["parallelism"] = {"dp": 2}
    with shared_default_group():
        pc = ParallelContext(2, 1, 1)
        tr = Trainer(config_from_dict(data), pc, stream=io.StringIO())
        steps = [tr.train_step().step for _ in range(2)]  # replicas agree: no error
        if dist.get_rank() == 1:
            with torch.no_grad():
                dict(tr.state.model.named_parameters())["decoder.1.mlp.down.weight"][0, 0] += 1.0
        try:
            tr.train_step()
            message = ""
        except SanityCheckError as exc:
            message = str(exc)
        tr.close()
        # checkpoints_path_is_shared_file_system: true is checked: one folder seen by both
        # ranks passes; a relative path from different working directories is not shared.
        from nanotron_train.checkpoints import CheckpointError
        from nanotron_train.checkpoints.save import check_shared

        shared = []
        check_shared(Path(tmp) / "shared", pc)
        os.chdir(Path(tmp) / f"rank{dist.get_rank()}")
        try:
            check_shared(Path("ck"), pc)
        except CheckpointError as exc:
            shared.append(str(exc))
        pc.destroy()
    return len(steps), message, shared


def test_sanity_checks_and_shared_file_system_check(tmp_path):
    from nanotron_parallel.testing import run_distributed

    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    for steps, message, shared in run_distributed(_sanity_run, 2, str(tmp_path), timeout=120):
        assert steps == 2
        assert message == "step 3: dp replicas disagree on decoder.1.mlp.down.weight"
        assert shared == [
            "ck: checkpoints.checkpoints_path_is_shared_file_system is true but rank 1 does not "
            "see rank 0's files there"
        ]
    assert list((tmp_path / "shared").iterdir()) == []  # the marker is removed


def test_num_loading_workers_prefetch_same_batches_and_position(tmp_path):
    """Prefetching (Nanotron's default: 1 worker) changes nothing but timing: the same losses
    as without, and a checkpoint taken while a step is prefetched resumes exactly."""
    from nanotron_train.data.testing import make_id_nanoset

    nanoset = make_id_nanoset(tmp_path / "ns", [50] * 20, low=1, high=60, vocab_size=64)
    runs = {}
    for workers in (0, 3):
        data = _stages_config(tmp_path / f"w{workers}", nanoset, 6)
        for stage in data["data_stages"]:
            stage["data"]["num_loading_workers"] = workers
        tr = _trainer(data)
        assert type(tr.state.data).__name__ == ("Prefetched" if workers else "StagedData")
        runs[workers] = [r["lm_loss"] for r in _records(tr)]
    assert runs[0] == runs[3]


def test_launcher_user_errors_are_one_line_and_status_2(tmp_path, capsys):
    """Under `python -m nanotron_train.launch` (torchrun inside) a config error is caught
    before any process starts, and a data error in the workers is still one line, status 2."""
    import os
    import subprocess
    import sys

    from nanotron_train.launch import main as launch

    data = tiny_config()
    data["parallelism"] = {"dp": 2}
    (tmp_path / "empty").mkdir()  # a folder, but no Nanoset: found by the workers' data path
    data["data_stages"][0]["data"]["dataset"] = {"dataset_folder": str(tmp_path / "empty")}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    assert launch(["--standalone", "--nproc_per_node=4", "--config-file", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}: parallelism: dp*tp*pp = 2*1*1 = 2 but the world size is 4\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "nanotron_train.launch", "--standalone", "--nproc_per_node=2",
         "--config-file", str(path)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: {tmp_path / 'empty' / 'metadata.json'}: missing Nanoset metadata "
        "(is this a Nanoset folder?)\n"
    )


@pytest.mark.parametrize(
    "key, value, expect",
    [
        ("checkpoints.resume_checkpoint_path", "s3://bucket/ckpt/10", "asks for checkpoints on S3"),
        (
            "model.model_config._attn_implementation",
            "flex_attention",
            "ring attention under context parallel",
        ),
        ("model.model_config.is_llama_config", False, "says is_qwen2_config: true instead"),
        ("model.init_method.scaling_method", "LAYER_INDEX", "not implemented by Nanotron either"),
        ("optimizer.optimizer_factory.name", "sgd", "name: sgd takes none of adam_beta1"),
    ],
)
def test_nanotron_values_we_refuse_name_the_key(key, value, expect):
    data = example()
    named = _set(data, key, value)
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, "ex.yaml", world_size=8)
    text = str(err.value)
    assert expect in text and "\n" not in text
    assert text.startswith(f"ex.yaml: {named.rsplit('.', 1)[0] if 'sgd' in expect else named}")


def test_nanotron_defaults_and_attention_names():
    data = example()
    data["profiler"] = {"profiler_export_path": "tb"}
    data["model"]["model_config"]["_attn_implementation"] = "sdpa"
    cfg = config_from_dict(data, "ex.yaml", world_size=8)
    assert (cfg.profiler.skip_first, cfg.profiler.with_stack) == (3, True)  # Nanotron's
    assert cfg.model.model_config.attention_backend == "sdpa"
    data["model"]["model_config"]["_attn_implementation"] = None
    assert (
        config_from_dict(data, "ex.yaml", world_size=8).model.model_config.attention_backend
        == "auto"
    )


def test_nanotron_context_parallel_config_loads_with_its_meaning():
    """Nanotron's long-context settings (context_parallel_size with llama3_ring_attention) are
    accepted: the world is dp*cp*tp*pp, and the attention is the all-gather one."""
    data = example()
    data["parallelism"]["context_parallel_size"] = 2
    data["model"]["model_config"]["_attn_implementation"] = "llama3_ring_attention"
    cfg = config_from_dict(data, "ex.yaml", world_size=16)
    assert cfg.parallelism.context_parallel_size == 2
    assert cfg.global_batch_size == 2 * 1 * 2  # cp ranks share sequences, not samples
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, "ex.yaml", world_size=8)
    assert str(err.value) == (
        "ex.yaml: parallelism: dp*cp*tp*pp = 2*2*2*2 = 16 but the world size is 8"
    )


@pytest.mark.parametrize(
    "changes, key, expect",
    [
        ({"context_parallel_size": 0}, "parallelism.context_parallel_size", "must be >= 1, got 0"),
        (
            {"context_parallel_size": 3},
            "data_stages.0.sequence_length",
            "256 must be divisible by 2*context_parallel_size = 6 (context parallel cuts every "
            "sequence into 2*cp equal chunks)",
        ),
        (
            {"context_parallel_size": 2, "tp": 4, "sequence_length": 20},
            "data_stages.0.sequence_length",
            "20 must be divisible by context_parallel_size * tp = 8 in REDUCE_SCATTER mode "
            "(each cp rank's 10 tokens are split over tp)",
        ),
    ],
)
def test_context_parallel_combinations_refused_in_one_line(changes, key, expect):
    data = example()
    if "sequence_length" in changes:
        data["data_stages"][0]["sequence_length"] = changes.pop("sequence_length")
    data["parallelism"].update(changes)
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, "ex.yaml")
    assert str(err.value) == f"ex.yaml: {key}: {expect}"
