"""LlamaConfig validation: every bad value fails with a message naming the field."""

from __future__ import annotations

import pytest

from nanotron_models import LlamaConfig, ModelConfigError


def _good(**overrides) -> LlamaConfig:
    fields = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def test_valid_config_passes_and_defaults_kv_heads():
    assert _good().validate(tp=2) is not None
    assert LlamaConfig(num_attention_heads=8, num_key_value_heads=None).num_key_value_heads == 8


@pytest.mark.parametrize(
    ("overrides", "tp", "field"),
    [
        ({"hidden_size": 0}, 1, "hidden_size"),
        ({"hidden_size": 66}, 1, "hidden_size"),
        ({"num_key_value_heads": 3}, 1, "num_key_value_heads"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 60},
            4,
            "num_attention_heads (6) must be divisible by tp (4)",
        ),
        ({}, 4, "num_key_value_heads (2) is smaller than tp (4)"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 60},
            2,
            "num_key_value_heads (3) must be divisible by tp (2)",
        ),
        (
            {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64},
            8,
            "num_key_value_heads",
        ),
        ({"intermediate_size": 95}, 2, "intermediate_size"),
        ({"vocab_size": -1}, 1, "vocab_size"),
        ({"rms_norm_eps": 0.0}, 1, "rms_norm_eps"),
        ({"rope_theta": -5.0}, 1, "rope_theta"),
        ({"hidden_act": "gelu"}, 1, "hidden_act"),
        ({"attn_backend": "xformers"}, 1, "attn_backend"),
        ({"eos_token_id": 500}, 1, "eos_token_id"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, 1, "rope_scaling.rope_type"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            1,
            "rope_scaling.low_freq_factor",
        ),
        ({"rope_interleaved": True}, 1, "rope_interleaved"),
    ],
)
def test_bad_values_name_the_field(overrides, tp, field):
    with pytest.raises(ModelConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        _good(**overrides).validate(tp=tp)


def test_error_is_a_value_error_and_unknown_keys_are_refused():
    assert issubclass(ModelConfigError, ValueError)
    with pytest.raises(ModelConfigError, match="unknown key.*'hiden_size'"):
        LlamaConfig.from_dict({"hiden_size": 64})
    assert LlamaConfig.from_dict(_good().to_dict()) == _good()
