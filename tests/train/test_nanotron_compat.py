"""A Nanotron user's config works here: every Nanotron key is implemented or refused in one
line, the table in docs/configuration.md says which and cannot drift, and Nanotron's own
example YAML loads with Nanotron's meanings. Training on Nanotron's keys:
test_nanotron_compat_training.py and test_nanotron_compat_runtime.py."""

from __future__ import annotations

import dataclasses
import datetime
import re
import types
import typing
from pathlib import Path

import pytest

from nanotron_train.config import Config, ConfigError, config_from_dict, expand_run_name
from tests.train.nanotron_compat_helpers import HERE, example

REPO = Path(__file__).resolve().parents[2]
NANOTRON_KEYS = [k.strip() for k in (HERE / "nanotron_keys.txt").read_text().splitlines()]


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
