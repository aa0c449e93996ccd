"""The Qwen2 family in one process: Hugging Face's Qwen2ForCausalLM and SmolLM3ForCausalLM
(NoPE layers, sliding windows) computed and converted both ways, and document masking proven
by value (a packed sequence's loss is the token-weighted loss of its documents run alone)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models_helpers import rel_err

from nanotron_models import KVCache, Qwen2Config, build_llama, full_state_dict, masks
from nanotron_models.families import family_of, family_of_hf
from nanotron_models.hf import hf_state_dict_to_ours, our_full_state_dict_to_hf
from nanotron_models.hf_qwen2 import qwen2_config_from_hf, qwen2_config_to_hf
from nanotron_models.masks import AttentionMask, document_ids, masked_attention

WINDOW = 5


def qwen2_config(**overrides) -> Qwen2Config:
    """hidden 64, 4 heads / 2 kv heads, 4 layers, odd vocab; a window shorter than the tests'
    sequences."""
    fields = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=64,
        rope_theta=500000.0,
        sliding_window_size=WINDOW,
        _attn_implementation="sdpa",
    )
    fields.update(overrides)
    return Qwen2Config(**fields)


CONFIGS = {
    # Qwen2: q/k/v biases, a window on every layer, position interpolation
    "qwen2": qwen2_config(attention_bias=True, rope_seq_len_interpolation_factor=2.0),
    # SmolLM3: every 2nd layer NoPE (and windowless), tied embeddings
    "smollm3": qwen2_config(no_rope_layer=2, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def hf_models():
    """One random-weight transformers model per config (built here, never downloaded), with
    biases and norms randomised so that a dropped or swapped one would show."""
    import transformers

    models = {}
    for i, (name, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        hc = qwen2_config_to_hf(config)
        hc._attn_implementation = "eager"
        cls = transformers.Qwen2ForCausalLM if name == "qwen2" else transformers.SmolLM3ForCausalLM
        model = cls(hc).float().eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif pname.endswith("bias"):
                    p.normal_(0.0, 0.1)
        models[name] = model
    return models


def _ours(pc, name, hf):
    config = CONFIGS[name]
    model = build_llama(config, pc, seed=0)
    model.load_state_dict(hf_state_dict_to_ours(hf.state_dict(), config), strict=True)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_hf_and_round_trips(pc1, hf_models, name):
    config, hf = CONFIGS[name], hf_models[name]
    assert type(hf).__name__ == family_of(config).hf.architecture(config)
    assert family_of_hf(hf.config).name == "qwen2"
    back = qwen2_config_from_hf(hf.config.to_dict())
    assert dataclasses.replace(back, _attn_implementation="sdpa") == config
    model = _ours(pc1, name, hf)
    ids = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    assert rel_err(model.logits(ids), expected) < 1e-5
    back = our_full_state_dict_to_hf(full_state_dict(model), config)
    hf_sd = hf.state_dict()
    assert set(back) == set(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_cache_and_greedy_generation_equal_hf(pc1, hf_models, name):
    """Past the window: the cache path applies it as HF does."""
    from nanotron_train.inference.decoding import generate

    config, hf = CONFIGS[name], hf_models[name]
    model = _ours(pc1, name, hf)
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    full = model.logits(ids)
    cache = KVCache()
    parts = [model.logits(ids[:, :6], kv_cache=cache), model.logits(ids[:, 6:], kv_cache=cache)]
    assert rel_err(torch.cat(parts, dim=1), full) < 1e-5
    ours = torch.cat((ids[:, :4], torch.tensor(generate(model, ids[:, :4].tolist(), 9).tokens)), 1)
    theirs = hf.generate(
        ids[:, :4],
        attention_mask=torch.ones_like(ids[:, :4]),
        max_new_tokens=9,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(ours, theirs)


def _packed(lengths: list[int], vocab: int, seed: int):
    """One row packing documents of `lengths` (positions restart at each), labels masked at
    the last token of each document (its target opens the next one)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths) + 1), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    mask = torch.ones(1, sum(lengths), dtype=torch.bool)
    ends = torch.tensor(lengths).cumsum(0) - 1
    mask[0, ends] = False
    return {
        "input_ids": ids[:, :-1].contiguous(),
        "label_ids": ids[:, 1:].contiguous(),
        "label_mask": mask,
        "position_ids": pos,
    }


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_loss_is_token_weighted_loss_of_each_document_alone(pc1, family):
    """Document masking (+ window + NoPE for Qwen2; Llama's key alone): the packed loss and
    gradients equal those of each document run alone, weighted by its labelled tokens (1e-5).
    Without the mask they differ."""
    from models_helpers import tiny_config

    if family == "qwen2":
        config = qwen2_config(no_rope_layer=2, _use_doc_masking=True)
        unmasked = qwen2_config(no_rope_layer=2)
    else:
        config = tiny_config(_use_doc_masking=True)
        unmasked = tiny_config()
    lengths = [7, 3, 9, 5]
    batch = _packed(lengths, config.vocab_size, seed=3)
    model = build_llama(config, pc1, seed=4)
    packed = model(None, batch)
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total, start, n_labels = 0.0, 0, int(batch["label_mask"].sum())
    for n in lengths:
        doc = {k: v[:, start : start + n] for k, v in batch.items()}
        doc["position_ids"] = torch.arange(n)[None]
        count = int(doc["label_mask"].sum())
        if count:
            loss = model(None, doc) * count / n_labels
            loss.backward()
            total += float(loss.detach())
        start += n
    assert float(packed) == pytest.approx(total, rel=1e-5)
    for name, p in model.named_parameters():
        assert rel_err(p.grad, packed_grads[name]) < 1e-5, name
    crossing = build_llama(unmasked, pc1, seed=4)
    assert abs(float(crossing(None, batch)) - total) > 1e-3


def test_mask_by_index_and_flex_kernel_equal_explicit_sdpa():
    """The mask is a function of global indices (what context parallel hands the kernel):
    a block of queries at positions 8..15 against keys 0..15 sees what the full mask says;
    flex attention (uncompiled here) computes what sdpa with the explicit mask does."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6], [3, 4] + list(range(14))])
    docs = document_ids(pos)
    assert docs[0].tolist() == [1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3]
    assert docs[1].tolist() == [1, 1] + [2] * 14  # a row starting inside a document
    mask = AttentionMask(docs, window=4)
    full = mask(torch.arange(16), torch.arange(16))
    assert full.shape == (2, 1, 16, 16)
    assert torch.equal(mask(torch.arange(8, 16), torch.arange(16)), full[:, :, 8:])
    i, j = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    same = docs[:, :, None] == docs[:, None, :]
    assert torch.equal(full[:, 0], same & (j <= i) & (i - j < 4))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(16, 2, 4, 8, generator=gen)
    k, v = torch.randn(16, 2, 2, 8, generator=gen), torch.randn(16, 2, 2, 8, generator=gen)
    index = torch.arange(16)
    sdpa = masked_attention(q, k, v, index, index, mask, "sdpa")
    flex = masks._flex(q, k, v, index, index, mask, compiled=False)
    assert rel_err(flex, sdpa) < 1e-5


@pytest.mark.parametrize(
    "changes, expect",
    [
        ({"moe_config": {"num_experts": 2, "top_k": 3}}, "model_config.moe_config.top_k (3) must"),
        ({"no_rope_layer": 3}, "model_config.no_rope_layer (3) must divide num_hidden_layers"),
        ({"flex_attention_mask": "document"}, "model_config.flex_attention_mask is set but"),
        ({"_use_qkv_packed": False}, "model_config._use_qkv_packed: false"),
        ({"ring_attn_heads_k_stride": 1}, "model_config.ring_attn_heads_k_stride is 1 but"),
        ({"_attn_implementation": "ring"}, "model_config._attn_implementation must be one of"),
        ({"sliding_window_size": 0}, "model_config.sliding_window_size must be null or"),
    ],
)
def test_qwen2_values_refused_in_one_line(changes, expect):
    from nanotron_models import ModelConfigError

    with pytest.raises(ModelConfigError) as err:
        qwen2_config(**changes).validate()
    assert str(err.value).startswith(expect) and "\n" not in str(err.value)


def test_flops_count_windows_and_block_costs():
    from nanotron_models.flops import attended_keys

    config = qwen2_config(no_rope_layer=2)  # layers 0, 2 windowed (5 keys), 1, 3 full
    assert attended_keys(config, 32) == 5 + 32 + 5 + 32
    fam = family_of(config)
    plain = qwen2_config(sliding_window_size=None, no_rope_layer=2)
    diff = fam.training_flops_per_token(plain, 32) - fam.training_flops_per_token(config, 32)
    assert diff == 12 * 64 * 2 * (32 - 5)
    costs = fam.block_costs(config, 32)
    assert costs[1] < costs[2] and costs[1] == costs[3]
