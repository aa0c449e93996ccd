"""A Llama with `moe_config` is Hugging Face's Mixtral: a random transformers
MixtralForCausalLM's weights give our model its logits (within 1e-5), ours written back in the
Hub's layout (block_sparse_moe, w1 / w3 / w2) load in transformers with the same logits, and
the convert commands carry a Mixtral folder through a checkpoint (its YAML config a Llama with
moe_config) and back with every tensor unchanged."""

from __future__ import annotations

import pytest
import torch
from models_helpers import rel_err

from nanotron_models import LlamaConfig, build_llama, full_state_dict
from nanotron_models.config import ModelConfigError
from nanotron_models.families import family_of_hf
from nanotron_models.hf_mixtral import mixtral_config_to_hf
from nanotron_models.moe import MoEConfig

MOE = dict(num_experts=4, top_k=2, moe_intermediate_size=16, norm_topk_prob=True)


def mixtral_llama(**moe) -> LlamaConfig:
    """hidden 32, 4 heads / 2 kv heads, 2 layers, each 4 experts of 16, top-2."""
    return LlamaConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, rope_theta=1e6,
        _attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
        moe_config=MoEConfig(**{**MOE, **moe}),
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf_mixtral():
    """A random transformers MixtralForCausalLM, its router and experts large enough that the
    routing is far from ties."""
    import transformers

    torch.manual_seed(0)
    hc = mixtral_config_to_hf(mixtral_llama())
    hc._attn_implementation = "eager"
    model = transformers.MixtralForCausalLM(hc).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def test_mixtral_logits_both_ways(pc1, hf_mixtral, tmp_path):
    import transformers
    from safetensors.torch import save_file

    family = family_of_hf(hf_mixtral.config)
    config = family.hf.config_from_hf(hf_mixtral.config).validate()
    assert family.name == "llama" and config.moe_config.moe_layers(2) == [0, 1]
    assert (config.moe_config.num_experts, config.moe_config.top_k) == (4, 2)
    hf_sd = {k: v.detach() for k, v in hf_mixtral.state_dict().items()}
    ours = build_llama(config, pc1)
    ours.load_state_dict(family.hf.state_dict_from_hf(hf_sd, config), strict=True)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = hf_mixtral(ids).logits
        assert rel_err(ours.logits(ids), want) < 1e-5
    # ours -> the Hub's layout -> transformers loads it (its own conversion) -> same logits
    hub = family.hf.state_dict_to_hf(full_state_dict(ours), config)
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in hub
    assert not any(".mlp." in k or "shared_expert" in k for k in hub)
    hc = family.hf.config_to_hf(config)
    hc.architectures = [family.hf.architecture(config)]
    hc.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hub.items()}, str(tmp_path / "model.safetensors"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(again).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        assert rel_err(again.float().eval()(ids).logits, want) < 1e-5
    back = family.hf.state_dict_from_hf(hub, config)  # the Hub's layout reads back
    assert all(torch.equal(t, back[n]) for n, t in full_state_dict(ours).items())


@pytest.mark.parametrize(
    ("moe", "other", "key"),
    [
        ({"layers": [1]}, {}, "moe_config.layers [1]"),
        ({"enable_shared_expert": True, "shared_expert_intermediate_size": 8}, {},
         "moe_config.enable_shared_expert"),
        ({"norm_topk_prob": False}, {}, "norm_topk_prob: true"),
        ({}, {"attention_bias": True}, "model_config.attention_bias"),
    ],
)  # fmt: skip
def test_what_mixtral_cannot_say_is_one_line(moe, other, key):
    import dataclasses

    config = dataclasses.replace(mixtral_llama(**moe), **other)
    with pytest.raises(ModelConfigError, match="cannot be written as a Hugging Face Mixtral") as e:
        mixtral_config_to_hf(config)
    assert key in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("key", "value"), [("sliding_window", 16), ("router_jitter_noise", 0.1)])
def test_what_llama_cannot_say_of_a_mixtral_is_one_line(hf_mixtral, key, value):
    from nanotron_models.hf_mixtral import mixtral_config_from_hf

    hc = {**hf_mixtral.config.to_dict(), key: value}
    with pytest.raises(ModelConfigError, match=f"Mixtral's {key}={value} is not supported"):
        mixtral_config_from_hf(hc)


def test_convert_mixtral_folder_from_hf_and_back(hf_mixtral, tmp_path):
    """save_pretrained's folder -> our checkpoint (its config.yaml a Llama with moe_config) ->
    a folder transformers loads as Mixtral, every tensor unchanged."""
    import transformers

    from nanotron_train.config import load_config
    from nanotron_train.convert import main as convert_main

    hf_mixtral.save_pretrained(tmp_path / "hf")
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert convert_main(["from-hf", "--hf-path", str(tmp_path / "hf"), "--out", str(ckpt)]) == 0
    mc = load_config(ckpt / "0" / "config.yaml").model.model_config
    assert type(mc) is LlamaConfig and mc.moe_config.num_experts == 4
    argv = ["to-hf", "--ckpt-path", str(ckpt), "--out", str(back), "--no-tokenizer"]
    assert convert_main(argv) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(back).float()
    assert type(again).__name__ == "MixtralForCausalLM"
    theirs = hf_mixtral.state_dict()
    assert sorted(again.state_dict()) == sorted(theirs)
    assert all(torch.equal(t, theirs[k]) for k, t in again.state_dict().items())
