"""The Mamba-2 / hybrid family against Hugging Face: locally built random Mamba2ForCausalLM and
NemotronHForCausalLM (pattern M*-ME*M: Mamba-2, attention, MLP, experts with Nemotron-H's
grouped sigmoid router, its score-correction bias and routed scaling), their A_log, D, dt_bias,
norms and router bias randomised, give our logits within 1e-5 (relative) after import, the
state dicts and configs round-trip exactly (experts written per expert, the Hub's layout), and
greedy generation through our `generate` (conv + SSM state, KV cache for the attention layers)
equals transformers'."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nanotron_models.families import family, family_of_hf, load_full_state_dict  # noqa: E402

VOCAB = 96
PATTERN = "M*-ME*M"


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, the per-head A_log, D, dt_bias and the norms included, with
    values of a trained model's scale (A_log ~ log 1..16, dt_bias softplus^-1 of 1e-3..0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            u = torch.rand(p.shape, generator=gen)
            if leaf == "A_log":
                p.copy_(torch.log(1 + 15 * u))
            elif leaf == "dt_bias":
                dt = torch.exp(
                    u * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3)))
                    + torch.log(torch.tensor(1e-3))
                )
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif leaf == "D" or "norm" in name:
                p.copy_(0.5 + u)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers the choice: spread it
                b.copy_(torch.rand(b.shape, generator=gen) * 0.2)


def _mamba2():
    cfg = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, n_groups=2, state_size=8,
        num_hidden_layers=3, chunk_size=8, conv_kernel=4, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.Mamba2ForCausalLM(cfg)


def _nemotron_h():
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern=PATTERN, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return transformers.NemotronHForCausalLM(cfg)


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h"])
def pair(request, pc1):
    """(HF model, our stage built from it, our config) for each architecture."""
    torch.manual_seed(0)
    hf = (_mamba2 if request.param == "mamba2" else _nemotron_h)().float().eval()
    _randomise(hf, seed=3)
    row = family_of_hf(hf.config)
    config = row.hf.config_from_hf(hf.config)
    ours = row.build_stage(config, pc1, row.block_names(config), seed=1)
    load_full_state_dict(ours, row.hf.state_dict_from_hf(hf.state_dict(), config))
    return hf, ours.eval(), config


def test_logits_equal_transformers(pair):
    hf, ours, config = pair
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(ids).logits
    got = ours.logits(ids)
    assert family("mamba2").hf.architecture(config) == type(hf).__name__
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_state_dicts_round_trip_exactly(pair):
    hf, ours, config = pair
    row = family("mamba2")
    # the files' names (save_pretrained writes NemotronH's `model.` as `backbone.`)
    hf_sd = {k.replace("model.", "backbone.", 1): v for k, v in hf.state_dict().items()}
    hf_sd = _per_expert(hf_sd)
    back = row.hf.state_dict_to_hf(row.hf.state_dict_from_hf(hf.state_dict(), config), config)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    ours, from_hub = (row.hf.state_dict_from_hf(sd, config) for sd in (hf.state_dict(), back))
    assert all(torch.equal(from_hub[k], v) for k, v in ours.items())  # per-expert names read
    again = row.hf.config_from_hf(row.hf.config_to_hf(config))
    assert again == config


def _per_expert(sd: dict) -> dict:
    """transformers 5's fused expert tensors [E, out, in] under the Hub's per-expert names."""
    out = {}
    for key, value in sd.items():
        if key.endswith(("experts.up_proj", "experts.down_proj")):
            base, proj = key.rsplit(".", 1)
            out.update({f"{base}.{j}.{proj}.weight": w for j, w in enumerate(value)})
        else:
            out[key] = value
    return out


def test_greedy_generation_equals_transformers(pair):
    from nanotron_train.inference.decoding import generate

    hf, ours, config = pair
    prompts = [[5, 9, 11, 3, 17, 4, 8, 30, 2 + 1], [7, 21, 6]]  # different lengths: left padding
    got = generate(ours, prompts, max_new_tokens=6, eos_token_id=None).tokens
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert tokens == want[0, len(prompt) :].tolist()
