"""The Mamba-2 hybrid family's own rules: packed documents equal each document alone (values
and gradients: the Mamba-2 state and conv reset at each boundary, attention masked); the tp
refusals name their key in one line; decoding holds a constant-size state per Mamba-2 layer."""

from __future__ import annotations

import pytest
import torch

from nanotron_models.config import ModelConfigError
from nanotron_models.families import family
from nanotron_models.mamba2_hybrid.config import Mamba2HybridConfig

DOCS = [7, 3, 12, 10]  # 32 tokens; the scan's chunk of 8 is crossed by documents


def _config(**kw) -> Mamba2HybridConfig:
    base = dict(hybrid_override_pattern="M*-M", num_hidden_layers=4, vocab_size=64, hidden_size=32,
                num_heads=4, head_dim=16, n_groups=2, state_size=8, chunk_size=8,
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                _use_doc_masking=True, attn_backend="sdpa")  # fmt: skip
    return Mamba2HybridConfig(**{**base, **kw})


def test_packed_documents_equal_each_document_alone(pc1):
    row, config = family("mamba2"), _config()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (1, sum(DOCS) + 1), generator=gen)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    mask = torch.ones(1, pos.shape[1], dtype=torch.bool)
    batch = {"input_ids": ids[:, :-1], "label_ids": ids[:, 1:], "position_ids": pos,
             "label_mask": mask}  # fmt: skip
    packed = row.build_stage(config, pc1, row.block_names(config), seed=2)
    loss = packed(None, batch)
    loss.backward()
    alone = row.build_stage(config, pc1, row.block_names(config), seed=2)
    expected, start = 0.0, 0
    for n in DOCS:
        doc = {k: v[:, start : start + n] for k, v in batch.items()}
        part = alone(None, {**doc, "position_ids": torch.arange(n)[None]}) * n / pos.shape[1]
        part.backward()
        expected, start = expected + float(part.detach()), start + n
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    for (name, p), q in zip(packed.named_parameters(), alone.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6 * float(q.grad.abs().max())), (
            name
        )
    plain = row.build_stage(_config(_use_doc_masking=False), pc1, row.block_names(config), seed=2)
    assert abs(float(plain(None, batch)) - expected) > 1e-3  # without resets it differs


@pytest.mark.parametrize(
    ("kw", "tp", "key"),
    [
        ({"num_heads": 6, "n_groups": 2, "head_dim": 16, "expand": 3}, 4, "num_heads (6) must be divisible by tp (4)"),
        ({"n_groups": 1}, 2, "n_groups (1) must be divisible by tp (2)"),
        ({"num_heads": 4, "n_groups": 8, "head_dim": 16}, 1, "num_heads (4) must be a multiple of n_groups (8)"),
        ({"hybrid_override_pattern": "M*EM", "n_group": 3}, 1, "model_config.n_group (3) must divide n_routed_experts (8)"),
        ({"hybrid_override_pattern": "M*EM", "moe_latent_size": 8}, 1, "model_config.moe_latent_size:"),
        ({"hybrid_override_pattern": "M*EM", "num_experts_per_tok": 9}, 1, "model_config.num_experts_per_tok (9) is more than"),
        ({"hybrid_override_pattern": "M*EM", "n_routed_experts": 0}, 1, "model_config.n_routed_experts must be a positive integer"),
        ({"hybrid_override_pattern": "M*M"}, 1, "hybrid_override_pattern has 3 letters"),
    ],
)  # fmt: skip
def test_refusals_name_the_key_in_one_line(kw, tp, key):
    with pytest.raises(ModelConfigError) as err:
        _config(**kw).validate(tp)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_decoding_state_is_constant_per_token_for_mamba_layers(pc1):
    """The state after 5 and after 40 tokens: the Mamba-2 layers' part the same size, the
    attention's KV cache grown by 35 tokens' keys and values."""
    row, config = family("mamba2"), _config(_use_doc_masking=False)
    stage = row.build_stage(config, pc1, row.block_names(config), seed=1)
    sizes = []
    for n in (5, 40):
        state = row.new_decode_state(config)
        stage.logits(torch.randint(0, 64, (2, n)), None, state)
        mamba = sum(s.conv.nbytes + s.ssm.nbytes for s in state.ssm.values())
        sizes.append((mamba, state.nbytes() - mamba, sorted(state.ssm)))
    assert sizes[0][0] == sizes[1][0] > 0 and sizes[0][2] == [0, 3]
    kv_per_token = 2 * 2 * 2 * 8 * 4  # k and v, batch 2, 2 kv heads x 8, fp32
    assert sizes[1][1] - sizes[0][1] == 35 * kv_per_token


def test_mup_is_refused_in_one_line(pc1):
    """µP's forward multipliers are not in these layers: refused, not trained half-way."""
    row, config = family("mamba2"), _config()
    with pytest.raises(ModelConfigError, match="only sp for the Mamba-2 family"):
        row.build_stage(config, pc1, row.block_names(config), parametrization="spectral_mup")
