"""The Mamba-1 family (Nanotron's examples/mamba) against Hugging Face's MambaForCausalLM, and
its selective scan against the sequential recurrence.

A locally built random MambaForCausalLM (A_log, D, dt_proj's bias and the norms randomised,
untied and tied embeddings) gives our logits within 1e-5 (relative) after import, the state
dicts and configs round-trip exactly, and greedy generation through our `generate` (conv +
SSM state per layer) equals transformers'. The chunked scan equals a plain loop for any chunk
size, and packed documents equal each document alone (values and gradients).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nanotron_models.families import family, family_of_hf, load_full_state_dict  # noqa: E402
from nanotron_models.mixers import Mamba1Dims, Mamba1Mixer, selective_scan  # noqa: E402

VOCAB = 96


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random at a trained model's scale: A_log ~ log 1..16, dt_proj's bias
    softplus^-1 of 1e-3..0.1, D and the norms around 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            u = torch.rand(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * u))
            elif name.endswith("dt_proj.bias"):
                dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith(".D") or "norm" in name:
                p.copy_(0.5 + u)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request, pc1):
    """(HF model, our stage built from it, our config)."""
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=3, expand=2,
        conv_kernel=4, time_step_rank=5, use_conv_bias=True, tie_word_embeddings=request.param,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    hf = transformers.MambaForCausalLM(cfg).float().eval()
    _randomise(hf, seed=3)
    if request.param:
        hf.tie_weights()
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
    assert family("mamba1").hf.architecture(config) == "MambaForCausalLM"
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_state_dicts_and_config_round_trip_exactly(pair):
    hf, _, config = pair
    row = family("mamba1")
    hf_sd = hf.state_dict()
    back = row.hf.state_dict_to_hf(row.hf.state_dict_from_hf(hf_sd, config), config)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    assert row.hf.config_from_hf(row.hf.config_to_hf(config)) == config
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings


def test_greedy_generation_equals_transformers(pair):
    from nanotron_train.inference.decoding import generate

    hf, ours, _ = pair
    prompts = [[5, 9, 11, 3, 17, 4, 8, 30, 3], [7, 21, 6]]  # different lengths: left padding
    got = generate(ours, prompts, max_new_tokens=6, eos_token_id=None).tokens
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert tokens == want[0, len(prompt) :].tolist()


def _sequential(x, dt, A, B, C, D, z):
    """The recurrence as written, one token at a time (fp64)."""
    h = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=x.dtype)
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]) + D * x[:, t])
    return torch.stack(ys, 1) * torch.nn.functional.silu(z), h


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_chunked_scan_equals_the_sequential_recurrence(chunk):
    g = torch.Generator().manual_seed(0)
    b, length, d, n = 2, 29, 6, 4

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    x, z, B, C, D = r(b, length, d), r(b, length, d), r(b, length, n), r(b, length, n), r(d)
    dt = torch.nn.functional.softplus(r(b, length, d))
    A = -torch.exp(r(d, n))
    y, last = selective_scan(x, dt, A, B, C, D, z, chunk_size=chunk)
    want_y, want_last = _sequential(x, dt, A, B, C, D, z)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, want_last, rtol=1e-12, atol=1e-12)


def test_packed_documents_equal_separate_documents():
    """Two documents packed in one row with a reset give each document's own values and the
    same gradients as running them apart (conv and SSM state restart)."""
    torch.manual_seed(0)
    dims = Mamba1Dims(hidden_size=8, intermediate_size=16, state_size=4, time_step_rank=2,
                      chunk_size=4)  # fmt: skip
    mixer = Mamba1Mixer(dims, dtype=torch.float64)
    a, b = torch.randn(1, 7, 8, dtype=torch.float64), torch.randn(1, 6, 8, dtype=torch.float64)
    reset = torch.zeros(1, 13, dtype=torch.bool)
    reset[0, 7] = True
    packed = mixer(torch.cat((a, b), 1), reset)
    packed.square().sum().backward()
    packed_grads = [p.grad.clone() for p in mixer.parameters()]
    mixer.zero_grad()
    apart = torch.cat((mixer(a), mixer(b)), 1)
    apart.square().sum().backward()
    torch.testing.assert_close(packed, apart, rtol=1e-12, atol=1e-12)
    for got, p in zip(packed_grads, mixer.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-10, atol=1e-12)


def test_nanotron_names_of_the_example_map_both_ways():
    """Nanotron's example names a layer's parameters `model.decoder.{i}.pp_block.<ours>`, so
    weight-decay patterns written for either name match (x_proj and dt_proj included)."""
    from nanotron_train.interop.nanotron_names import excluded_from_weight_decay, to_nanotron

    theirs = "model.decoder.3.pp_block.mixer.x_proj.weight"
    assert to_nanotron("decoder.3.mixer.x_proj.weight") == theirs
    assert excluded_from_weight_decay("decoder.0.mixer.dt_proj.bias", [r"model\..*dt_proj"])
