"""The Qwen3-Next family's own rules: HF's layer-type and sparse-layer rules give the pattern;
packed documents equal each document alone (values and gradients: the Gated DeltaNet state and
conv reset at each boundary, attention masked, experts routed per token); the refusals name
their key in one line."""

from __future__ import annotations

import pytest
import torch

from nanotron_models.config import ModelConfigError
from nanotron_models.families import family
from nanotron_models.qwen3_next.config import Qwen3NextConfig

F64 = torch.float64  # fp32's summation order alone moves these gradients by ~5e-5
DOCS = [7, 3, 12, 10]  # 32 tokens; the delta rule's chunk of 8 is crossed by documents


def _config(**kw) -> Qwen3NextConfig:
    base = dict(num_hidden_layers=4, vocab_size=64, hidden_size=32, intermediate_size=48,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_chunk_size=8, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=24, mlp_only_layers=[1], full_attention_interval=2,
                _use_doc_masking=True, attn_backend="sdpa")  # fmt: skip
    return Qwen3NextConfig(**{**base, **kw})


def test_layer_types_and_sparse_layers_give_the_pattern():
    c = _config()
    assert c.layer_types == ["linear_attention", "full_attention"] * 2
    assert c.pattern == "GE*-GE*E" and c.moe_config.layers == [0, 2, 3]
    assert _config(decoder_sparse_step=2, mlp_only_layers=[]).pattern == "G-*EG-*E"
    assert _config(num_experts=0).moe_config is None
    assert Qwen3NextConfig(num_hidden_layers=8).pattern == "GEGEGE*E" * 2  # HF's defaults


def test_packed_documents_equal_each_document_alone(pc1):
    # no balance loss: it averages over the micro-batch's tokens, packed or not
    row, config = family("qwen3_next"), _config(router_aux_loss_coef=0.0)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (1, sum(DOCS) + 1), generator=gen)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    mask = torch.ones(1, pos.shape[1], dtype=torch.bool)
    batch = {"input_ids": ids[:, :-1], "label_ids": ids[:, 1:], "position_ids": pos,
             "label_mask": mask}  # fmt: skip
    packed = row.build_stage(config, pc1, row.block_names(config), seed=2, init_std=0.2, dtype=F64)
    loss = packed(None, batch)
    loss.backward()
    alone = row.build_stage(config, pc1, row.block_names(config), seed=2, init_std=0.2, dtype=F64)
    expected, start = 0.0, 0
    for n in DOCS:
        doc = {k: v[:, start : start + n] for k, v in batch.items()}
        part = alone(None, {**doc, "position_ids": torch.arange(n)[None]}) * n / pos.shape[1]
        part.backward()
        expected, start = expected + float(part.detach()), start + n
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    for (name, p), q in zip(packed.named_parameters(), alone.parameters(), strict=True):
        scale = float(q.grad.abs().max())
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale), name
    plain = _config(_use_doc_masking=False, router_aux_loss_coef=0.0)
    unmasked = row.build_stage(plain, pc1, row.block_names(plain), seed=2, init_std=0.2, dtype=F64)
    assert abs(float(unmasked(None, batch).detach()) - expected) > 1e-4  # without resets: differs


@pytest.mark.parametrize(
    ("kw", "tp", "key"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 4}, 4, "linear_num_key_heads (2) must be divisible by tp (4)"),
        ({"linear_num_value_heads": 3}, 1, "linear_num_value_heads (3) must be divisible by linear_num_key_heads (2)"),
        ({"num_key_value_heads": 2}, 4, "num_key_value_heads (2) must be divisible by tp (4)"),
        ({"layer_types": ["linear_attention", "mamba", "full_attention", "full_attention"]}, 1, "layer_types: each must be"),
        ({"layer_types": ["full_attention"]}, 1, "layer_types must list num_hidden_layers (4)"),
        ({"num_experts_per_tok": 5}, 1, "model_config.num_experts_per_tok (5) must be at most num_experts (4)"),
        ({"partial_rotary_factor": 0.375}, 1, "partial_rotary_factor (0.375)"),
        ({"hidden_act": "gelu"}, 1, "hidden_act must be 'silu'"),
    ],
)  # fmt: skip
def test_refusals_name_the_key_in_one_line(kw, tp, key):
    with pytest.raises(ModelConfigError) as err:
        _config(**kw).validate(tp)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_nanotron_names_agree_with_the_other_families():
    """The rows' Nanotron name tables merge (a name is one parameter whatever the family): the
    names Qwen3-Next shares with Llama keep Llama's Nanotron names."""
    from nanotron_models.families import FAMILIES
    from nanotron_train.interop.nanotron_names import from_nanotron, to_nanotron

    seen: dict[str, tuple[str, str]] = {}
    for row in FAMILIES.values():
        for ours, theirs in row.nanotron_names.layer.items():
            first = seen.setdefault(ours, (row.name, theirs))
            assert first[1] == theirs, (ours, first, (row.name, theirs))
    assert to_nanotron("decoder.3.input_norm.weight") == (
        "model.decoder.3.pp_block.input_layernorm.weight"
    )
    assert from_nanotron("model.decoder.3.pp_block.mixer.A_log") == "decoder.3.mixer.A_log"
