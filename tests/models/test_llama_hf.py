"""One process (tp=1): our Llama computes Hugging Face's function, and converts both ways."""

from __future__ import annotations

import pytest
import torch
from models_helpers import hf_model, hf_reference, rel_err, tiny_config

from nanotron_models import (
    KVCache,
    build_llama,
    build_llama_stage,
    full_state_dict,
    llama_block_names,
)
from nanotron_models.hf import (
    config_from_hf,
    config_to_hf,
    hf_state_dict_to_ours,
    our_full_state_dict_to_hf,
)
from nanotron_parallel.sharding import get_param_meta


@pytest.mark.parametrize("tie", [False, True])
def test_logits_loss_and_grads_match_hf(pc1, tie):
    config = tiny_config(tie)
    ref = hf_reference(config)
    model = build_llama(config, pc1, seed=3)
    model.load_state_dict(hf_state_dict_to_ours(ref["hf_sd"], config), strict=True)
    assert rel_err(model.logits(ref["batch"]["input_ids"]), ref["logits"]) < 1e-5
    loss = model(None, ref["batch"])
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert rel_err(loss.detach(), ref["loss"]) < 1e-5
    loss.backward()
    grads = our_full_state_dict_to_hf(full_state_dict(model, grads=True), config)
    assert set(grads) == set(ref["grads"])
    for name, expected in ref["grads"].items():
        assert rel_err(grads[name], expected) < 1e-5, name


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_hf_ours_hf_is_bitwise(pc1, tie):
    config = tiny_config(tie)
    hf_sd = hf_model(config, seed=5).state_dict()
    assert config_from_hf(config_to_hf(config)) == config
    model = build_llama(config, pc1, seed=0)
    model.load_state_dict(hf_state_dict_to_ours(hf_sd, config))
    back = our_full_state_dict_to_hf(full_state_dict(model), config)
    assert set(back) == set(hf_sd)
    for name, tensor in hf_sd.items():
        assert torch.equal(back[name], tensor), name
    if tie:
        assert model.lm_head.weight is model.embedding.weight


def test_kv_cache_decoding_and_greedy_generate_match_hf(pc1):
    from nanotron_train.inference.decoding import generate

    config = tiny_config(False)
    hf = hf_model(config, seed=7)
    model = build_llama(config, pc1, seed=0)
    model.load_state_dict(hf_state_dict_to_ours(hf.state_dict(), config))
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    full = model.logits(ids)
    cache = KVCache()
    parts = [model.logits(ids[:, :5], kv_cache=cache)]  # prompt, then 1, then 5 tokens at once
    parts.append(model.logits(ids[:, 5:6], kv_cache=cache))
    parts.append(model.logits(ids[:, 6:], kv_cache=cache))
    assert cache.offset == 11
    assert rel_err(torch.cat(parts, dim=1), full) < 1e-5
    ours = torch.cat((ids[:, :4], torch.tensor(generate(model, ids[:, :4].tolist(), 10).tokens)), 1)
    theirs = hf.generate(
        ids[:, :4],
        attention_mask=torch.ones_like(ids[:, :4]),
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(ours, theirs)


def test_two_stages_with_tied_embeddings_equal_one(pc1):
    config = tiny_config(True, num_hidden_layers=3)
    batch = hf_reference(config, seq=8)["batch"]
    names = llama_block_names(config)
    whole = build_llama(config, pc1, seed=11)
    first = build_llama_stage(config, pc1, names[:3], seed=11)  # embedding, decoder.0-1
    last = build_llama_stage(config, pc1, names[3:], seed=11)
    assert sorted(last.decoder) == ["2"] and not hasattr(last, "embedding")
    # The lm_head copy is rebuilt from the embedding's seed key and marked as tied.
    assert torch.equal(last.lm_head.weight, first.embedding.weight)
    for p in (last.lm_head.weight, first.embedding.weight):
        assert get_param_meta(p).tied_key == "embedding.weight"
    hidden = first(None, batch)
    assert hidden.shape == (8, 2, config.hidden_size)
    assert torch.equal(last(hidden, batch), whole(None, batch))


def test_stage_rejects_bad_block_lists(pc1):
    from nanotron_models import ModelConfigError

    config = tiny_config()
    with pytest.raises(ModelConfigError, match="contiguous"):
        build_llama_stage(config, pc1, ["embedding", "decoder.1"])
    with pytest.raises(ModelConfigError, match="decoder.7"):
        build_llama_stage(config, pc1, ["decoder.7"])
    with pytest.raises(ModelConfigError, match="attn_backend"):
        build_llama_stage(config, pc1, ["embedding"], attn_backend="xformers")


def test_full_state_dict_reloads_and_bad_hf_dicts_are_named(pc1):
    from nanotron_models import load_full_state_dict
    from nanotron_models.hf import HFConversionError
    from nanotron_parallel.sharding import unshard_tensor

    config = tiny_config(False)
    a, b = build_llama(config, pc1, seed=1), build_llama(config, pc1, seed=2)
    full_a = full_state_dict(a)
    assert not torch.equal(
        full_a["decoder.0.attn.qkv.weight"], full_state_dict(b)["decoder.0.attn.qkv.weight"]
    )
    load_full_state_dict(b, full_a)
    assert all(torch.equal(v, full_state_dict(b)[k]) for k, v in full_a.items())
    # tp=2 shards of a converted HF dict: fused sections split per rank, vocab padded to 102.
    hf_sd = our_full_state_dict_to_hf(full_a, config)
    shards = [hf_state_dict_to_ours(hf_sd, config, r, 2) for r in range(2)]
    assert shards[0]["embedding.weight"].shape == (51, 64)
    assert torch.equal(shards[1]["embedding.weight"][-1], torch.zeros(64))
    qkv = unshard_tensor([s["decoder.1.attn.qkv.weight"] for s in shards], 0, [64, 32, 32])
    assert torch.equal(qkv, full_a["decoder.1.attn.qkv.weight"])
    del hf_sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(HFConversionError, match="model.layers.1.mlp.up_proj.weight"):
        hf_state_dict_to_ours(hf_sd, config)
