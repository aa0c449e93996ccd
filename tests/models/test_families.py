"""The model family registry: lookups by name and by config, what the Llama row provides, and
that a second family is found by its config class once it has a row."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models_helpers import tiny_config

from nanotron_models import FAMILIES, LlamaConfig, ModelConfigError, family, family_of


def test_llama_is_found_by_name_and_by_config() -> None:
    assert sorted(FAMILIES) == ["llama", "qwen2"]
    llama = family("llama")
    assert family_of(tiny_config()) is llama
    assert (llama.config_class, llama.tied_key) == (LlamaConfig, "embedding.weight")
    assert (llama.hf.model_type, llama.hf.architectures[0]) == ("llama", "LlamaForCausalLM")
    assert llama.hf.reads("mixtral", None)  # with moe_config, Llama is HF's Mixtral
    with pytest.raises(
        ModelConfigError, match=r"model family 'gpt2' is not one of \['llama', 'qwen2'\]"
    ):
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
