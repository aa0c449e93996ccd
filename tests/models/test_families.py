"""The model family registry: lookups by name and by config, what the Llama row provides, and
that a second family is found by its config class once it has a row."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models_helpers import tiny_config

from nanotron_models import FAMILIES, LlamaConfig, ModelConfigError, family, family_of


def test_llama_is_found_by_name_and_by_config() -> None:
    assert sorted(FAMILIES) == ["llama", "mamba1", "mamba2", "qwen2", "qwen3_next"]
    llama = family("llama")
    assert family_of(tiny_config()) is llama
    assert (llama.config_class, llama.tied_key) == (LlamaConfig, "embedding.weight")
    assert (llama.hf.model_type, llama.hf.architectures[0]) == ("llama", "LlamaForCausalLM")
    assert llama.hf.reads("mixtral", None)  # with moe_config, Llama is HF's Mixtral
    known = r"\['llama', 'mamba1', 'mamba2', 'qwen2', 'qwen3_next'\]"
    with pytest.raises(ModelConfigError, match=rf"model family 'gpt2' is not one of {known}"):
        family("gpt2")
    with pytest.raises(ModelConfigError, match="no model family has the config class dict"):
        family_of({})


def test_the_llama_row_names_blocks_parameters_and_sizes(pc1) -> None:
    config = tiny_config(tie=True, num_hidden_layers=2)
    llama = family("llama")
    names = llama.block_names(config)
    assert names == ["embedding", "decoder.0", "decoder.1", "final_norm", "lm_head", "loss"]
    costs = llama.block_costs(config, 8)
    assert len(costs) == len(names) and costs[1] == costs[2] and costs[4] == 2 * 8 * 101 * 64
    # A tied lm_head is initialised from (seeded by) the name both copies share.
    assert llama.init_spec(config, "lm_head.weight", 0.02, 2).key == llama.tied_key
    stage = llama.build_stage(config, pc1, names[:2], seed=3)
    shapes = {n: tuple(p.shape) for n, p in stage.named_parameters()}
    assert shapes["embedding.weight"] == (101, 64)
    assert shapes["decoder.0.attn.qkv.weight"] == ((4 + 2 * 2) * 16, 64)
    assert llama.num_parameters(config) == sum(
        p.numel() for p in llama.build_stage(config, pc1, names, seed=3).parameters()
    )


def test_hf_mapping_of_the_row_round_trips_a_state_dict(pc1) -> None:
    config = tiny_config()
    llama = family("llama")
    stage = llama.build_stage(config, pc1, llama.block_names(config), seed=5)
    ours = {n: p.detach().clone() for n, p in stage.named_parameters()}
    hf_sd = llama.hf.state_dict_to_hf(ours, config)
    assert "model.layers.1.self_attn.k_proj.weight" in hf_sd
    back = llama.hf.state_dict_from_hf(hf_sd, config)
    assert sorted(back) == sorted(ours)
    assert all(torch.equal(back[n], ours[n]) for n in ours)


def test_a_second_family_is_one_row(monkeypatch) -> None:
    @dataclasses.dataclass
    class OtherConfig(LlamaConfig):
        sliding_window: int = 0

    other = dataclasses.replace(family("llama"), name="other", config_class=OtherConfig)
    # The more specific row first, as a subclass' family should be.
    monkeypatch.setattr(
        "nanotron_models.families.FAMILIES", {"other": other, **FAMILIES}, raising=True
    )
    assert family("other") is other and family_of(OtherConfig()) is other
    assert family_of(LlamaConfig()).name == "llama"


def test_a_built_stage_is_a_model_stage_and_the_row_decodes_it(pc1) -> None:
    """The declared stage interface (stage.py) is what a family's build_stage returns, and
    the row's decoding state carries an incremental decode equal to the whole sequence."""
    from nanotron_models.stage import ModelStage

    config = tiny_config(num_hidden_layers=2)
    llama = family("llama")
    stage = llama.build_stage(config, pc1, llama.block_names(config), seed=7)
    assert isinstance(stage, ModelStage)
    ids = torch.randint(0, config.vocab_size, (2, 6))
    whole = stage.logits(ids)
    state = llama.new_decode_state(config)
    steps = [stage.logits(ids[:, :4], None, state), stage.logits(ids[:, 4:], None, state)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_one_tp_plan_is_read_by_building_and_by_initialisation(pc1) -> None:
    """Every parameter's split, as the layer the block built declares it (ParamMeta on the
    meta-device parameter), is the row's tp_plan's and the init spec's."""
    from nanotron_models.blocks import linear_mode
    from nanotron_models.model import LlamaStage
    from nanotron_models.moe import MoEConfig
    from nanotron_parallel.sharding import get_param_meta

    moe = MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=32, enable_shared_expert=True,
                    shared_expert_intermediate_size=48)  # fmt: skip
    for config in (tiny_config(attention_bias=True), tiny_config(moe_config=moe)):
        llama = family_of(config)
        names = llama.block_names(config)
        stage = LlamaStage(config, pc1, names, linear_mode("ALL_REDUCE"), "sdpa", "meta",
                           torch.float32)  # fmt: skip
        for name, param in stage.named_parameters():
            meta = get_param_meta(param)
            built = None if meta is None else meta.shard_dim
            planned = llama.tp_plan.shard_dim(name)
            assert built == planned == llama.init_spec(config, name, 0.02, 1).shard_dim, name


def test_the_row_says_which_config_fields_make_the_architecture() -> None:
    """Arch keys are fields of the family's config; optional ones of some family's (a Llama
    checkpoint and a Qwen2 config, or the reverse, compare Qwen2's when either sets them)."""
    every = {f.name for row in FAMILIES.values() for f in dataclasses.fields(row.config_class)}
    for row in FAMILIES.values():
        fields = {f.name for f in dataclasses.fields(row.config_class)}
        assert set(row.arch_keys) <= fields and set(row.optional_arch_keys) <= every, row.name
        assert not set(row.arch_keys) & set(row.optional_arch_keys)
        assert all(n.startswith(row.layer_prefix) for n in row.block_names(row.config_class())
                   if "." in n)  # fmt: skip


def test_every_family_gives_one_of_our_names_one_nanotron_name() -> None:
    # The rows' Nanotron tables are merged into one map (weight-decay patterns, checkpoint
    # files), so a name two families share must map alike: a later row silently winning
    # would rename Llama's norms for every family.
    seen: dict[str, tuple[str, str]] = {}
    for name, row in FAMILIES.items():
        for table in (row.nanotron_names.top, row.nanotron_names.layer):
            for ours, theirs in table.items():
                first = seen.setdefault(ours, (name, theirs))
                assert first[1] == theirs, (ours, first, (name, theirs))
    assert seen["post_attn_norm.weight"][1] == "post_attention_layernorm.weight"
