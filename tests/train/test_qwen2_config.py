"""Nanotron's Qwen2Config here: the keys table of docs/configuration.md lists exactly Nanotron's
fields (tests/train/nanotron/qwen2_keys.txt), each is a field of ours with Nanotron's default,
each refused value is one line naming the key, and Llama has the document-masking key too."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from nanotron_models import LlamaConfig, Qwen2Config
from nanotron_train.config import ConfigError, config_from_dict

HERE = Path(__file__).parent / "nanotron"
REPO = Path(__file__).resolve().parents[2]
KEYS = (HERE / "qwen2_keys.txt").read_text().split()
# Nanotron's defaults at the commit qwen2_keys.txt was taken from (models_config.py)
NANOTRON_DEFAULTS = {
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 2048,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "vocab_size": 32000, "_attn_implementation": "flash_attention_2", "attention_bias": False,
    "z_loss_coefficient": 0.0001, "_fused_rotary_emb": True, "_fused_rms_norm": True,
    "_use_qkv_packed": True, "_use_doc_masking": False, "log_attn_probs": True,
}  # fmt: skip


def table() -> dict[str, str]:
    text = (REPO / "docs" / "configuration.md").read_text()
    block = text.split("<!-- nanotron-qwen2-keys:start -->")[1].split(
        "<!-- nanotron-qwen2-keys:end -->"
    )[0]
    return dict(re.findall(r"^\| `([^`]+)` \| (.+) \|$", block, flags=re.M))


def test_table_lists_every_nanotron_qwen2_key_with_its_default():
    assert sorted(table()) == sorted(KEYS)
    ours = [f.name for f in dataclasses.fields(Qwen2Config)]
    names = [k.rsplit(".", 1)[1] for k in KEYS]
    assert [n for n in names if n not in ours] == []
    assert ours[: len(names)] == names  # Nanotron's order, ours (attn_backend) after
    default = Qwen2Config()
    assert {k: getattr(default, k) for k in NANOTRON_DEFAULTS} == NANOTRON_DEFAULTS
    assert all(getattr(default, n) is None for n in names if n not in NANOTRON_DEFAULTS and
               n not in ("is_qwen2_config", "pretraining_tp", "rope_interleaved", "use_cache",
                         "z_loss_enabled"))  # fmt: skip


def _example() -> dict:
    return yaml.safe_load((HERE / "config_qwen.yaml").read_text())


REFUSED = {
    "_use_qkv_packed": (False, "Nanotron does not run either"),
    "rope_interleaved": (True, "rotate-half"),
    "use_cache": (False, "KV cache"),
    "pretraining_tp": (2, "must be 1"),
    "hidden_act": ("gelu", "SwiGLU"),
    "flex_attention_mask": ("document", "names a mask of flex_attention"),
    "ring_attn_heads_k_stride": (2, "belongs to llama3_ring_attention"),
    "_attn_implementation": ("ring_flash_triton", "must be one of"),
    "no_rope_layer": (5, "must divide num_hidden_layers"),
    "sliding_window_size": (-1, "null or a positive integer"),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_refused_values_are_one_line_naming_the_key(key):
    value, expect = REFUSED[key]
    data = _example()
    data["model"]["model_config"][key] = value
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, "q.yaml", world_size=4)
    text = str(err.value)
    assert text.startswith(f"q.yaml: model.model_config.{key}: ") and "\n" not in text
    assert expect in text, text


def test_flex_masks_windows_and_llama_document_masking():
    data = _example()
    mc = data["model"]["model_config"]
    mc.update(_attn_implementation="flex_attention", flex_attention_mask="sliding_window_document",
              sliding_window_size=16, _use_doc_masking=False, no_rope_layer=4)  # fmt: skip
    cfg = config_from_dict(data, "q.yaml", world_size=4).model.model_config
    assert cfg.attention_backend == "flex" and cfg.document_masking
    assert [cfg.sliding_window(i) for i in range(4)] == [16, 16, 16, None]
    mc.update(flex_attention_mask="sliding_window", _use_doc_masking=False)
    assert not config_from_dict(data, "q.yaml", world_size=4).model.model_config.document_masking
    llama = yaml.safe_load((HERE / "config_tiny_llama.yaml").read_text())
    llama["model"]["model_config"]["_use_doc_masking"] = True
    cfg = config_from_dict(llama, "l.yaml", world_size=8).model.model_config
    assert isinstance(cfg, LlamaConfig) and cfg.document_masking


def test_dashboard_run_start_carries_the_family_and_its_options():
    """The run's config view shows what run_start carries: the dashboard's message model takes
    a Qwen2 config whole, family marker and attention options included."""
    from nanotron_dashboard.messages import RunStart

    data = _example()
    data["model"]["model_config"].update(sliding_window_size=64, no_rope_layer=4)
    cfg = config_from_dict(data, "q.yaml", world_size=4)
    sent = RunStart(type="run_start", run_id="r", config=cfg.to_dict()).config
    mc = sent["model"]["model_config"]
    assert (mc["is_qwen2_config"], mc["_use_doc_masking"]) == (True, True)
    assert (mc["sliding_window_size"], mc["no_rope_layer"]) == (64, 4)
    assert sorted(mc) == sorted(f.name for f in dataclasses.fields(Qwen2Config))
