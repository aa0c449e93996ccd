"""The Qwen3-Next family against Hugging Face: locally built random Qwen3NextForCausalLM (Gated
DeltaNet and gated-attention layers; dense, and with experts plus a dense layer), every
parameter randomised (A_log, dt_bias, the zero-centred and gated norms included), give our
logits within 1e-5 (relative) after import, the state dicts and configs round-trip exactly,
and greedy generation through our `generate` (conv + delta-rule state per Gated DeltaNet
layer, KV cache for the attention layers) equals transformers'."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nanotron_models.families import family, family_of_hf, load_full_state_dict  # noqa: E402

VOCAB = 96
LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random at a trained model's scale: A_log ~ log 1..16, dt_bias around 0,
    the zero-centred norms' weights around 0, the gated norm's around 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            u = torch.rand(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * u))
            elif name.endswith("dt_bias"):
                p.copy_(u - 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(0.5 + u)
            elif "norm" in name:
                p.copy_(0.6 * u - 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def _qwen3_next(moe: bool):
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4 if moe else 0, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[1], layer_types=LAYERS,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return transformers.Qwen3NextForCausalLM(cfg)


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, pc1):
    """(HF model, our stage built from it, our config) for each variant."""
    torch.manual_seed(0)
    hf = _qwen3_next(request.param == "moe").float().eval()
    _randomise(hf, seed=3)
    row = family_of_hf(hf.config)
    config = row.hf.config_from_hf(hf.config)
    config.linear_chunk_size = 8  # several chunks: the chunked form against HF's
    ours = row.build_stage(config, pc1, row.block_names(config), seed=1)
    load_full_state_dict(ours, row.hf.state_dict_from_hf(hf.state_dict(), config))
    return hf, ours.eval(), config


def test_logits_equal_transformers(pair):
    hf, ours, config = pair
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(ids).logits
    got = ours.logits(ids)
    assert config.pattern in ("G-*-G-*-", "GE*-GE*E")
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def _fused_experts(sd: dict, config) -> dict:
    """HF's per-expert tensors (what we write, the Hub's layout) stacked back into the fused
    ones a transformers-5 model holds."""
    out = {}
    for key, value in sd.items():
        if ".mlp.experts." not in key:
            out[key] = value
    for i in config.moe_config.layers if config.moe_config else ():
        p = f"model.layers.{i}.mlp.experts"
        each = range(config.num_experts)
        gate_up = [torch.cat((sd[f"{p}.{j}.gate_proj.weight"], sd[f"{p}.{j}.up_proj.weight"]))
                   for j in each]  # fmt: skip
        out[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{j}.down_proj.weight"] for j in each])
    return out


def test_state_dicts_and_config_round_trip_exactly(pair):
    hf, ours, config = pair
    row = family("qwen3_next")
    hf_sd = hf.state_dict()
    written = row.hf.state_dict_to_hf(row.hf.state_dict_from_hf(hf_sd, config), config)
    assert all(t.is_contiguous() for t in written.values())  # what safetensors can write
    back = _fused_experts(written, config)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    again = row.hf.config_from_hf(row.hf.config_to_hf(config))
    assert again == dataclasses.replace(config, linear_chunk_size=64)  # ours, not HF's
    assert row.hf.architecture(config) == "Qwen3NextForCausalLM"


def test_greedy_generation_equals_transformers(pair):
    from nanotron_train.inference.decoding import generate

    hf, ours, config = pair
    prompts = [[5, 9, 11, 3, 17, 4, 8, 30, 3], [7, 21, 6]]  # different lengths: left padding
    got = generate(ours, prompts, max_new_tokens=6, eos_token_id=None).tokens
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert tokens == want[0, len(prompt) :].tolist()
