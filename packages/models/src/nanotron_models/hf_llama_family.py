"""The Llama family's Hugging Face mappings: Llama (with moe_config, Mixtral in Hugging Face's
terms: hf_mixtral.py) and Nanotron's Qwen2 (with moe_config, Qwen2-MoE: hf_qwen2_moe.py), each
choosing the converter by the config it is given."""

from __future__ import annotations

from typing import Any

from .config import LlamaConfig
from .family_row import HFMapping
from .hf import (
    config_from_hf,
    config_to_hf,
    hf_state_dict_to_ours_full,
    our_full_state_dict_to_hf,
)
from .hf_mixtral import (
    mixtral_config_from_hf,
    mixtral_config_to_hf,
    mixtral_state_dict_from_hf,
    mixtral_state_dict_to_hf,
)
from .hf_qwen2 import qwen2_architecture, qwen2_config_from_hf, qwen2_config_to_hf
from .hf_qwen2_moe import qwen2_moe_config_from_hf, qwen2_moe_config_to_hf
from .qwen2 import Qwen2Config


def _get(hf_config: Any, key: str) -> Any:
    return hf_config.get(key) if isinstance(hf_config, dict) else getattr(hf_config, key, None)


# Llama with moe_config is Mixtral in Hugging Face's terms (hf_mixtral.py).
def _llama_from_hf(hf_config: Any):
    if _get(hf_config, "model_type") == "mixtral":
        return mixtral_config_from_hf(hf_config)
    return config_from_hf(hf_config)


def _llama_to_hf(config: LlamaConfig):
    return mixtral_config_to_hf(config) if config.moe_config else config_to_hf(config)


def _llama_sd_from_hf(hf_sd: dict, config: LlamaConfig) -> dict:
    convert = mixtral_state_dict_from_hf if config.moe_config else hf_state_dict_to_ours_full
    return convert(hf_sd, config)


def _llama_sd_to_hf(full_sd: dict, config: LlamaConfig) -> dict:
    convert = mixtral_state_dict_to_hf if config.moe_config else our_full_state_dict_to_hf
    return convert(full_sd, config)


LLAMA_HF = HFMapping(
    model_type="llama",
    architectures=("LlamaForCausalLM", "MixtralForCausalLM"),
    config_from_hf=_llama_from_hf,
    config_to_hf=_llama_to_hf,
    state_dict_from_hf=_llama_sd_from_hf,
    state_dict_to_hf=_llama_sd_to_hf,
    model_types=("llama", "mixtral"),
    architecture_of=lambda c: "MixtralForCausalLM" if c.moe_config else "LlamaForCausalLM",
)


def _qwen2_from_hf(hf_config: Any):
    if _get(hf_config, "model_type") == "qwen2_moe":
        return qwen2_moe_config_from_hf(hf_config)
    return qwen2_config_from_hf(hf_config)


def _qwen2_to_hf(config: Qwen2Config):
    return qwen2_moe_config_to_hf(config) if config.moe_config else qwen2_config_to_hf(config)


def _qwen2_architecture(config: Qwen2Config) -> str:
    return "Qwen2MoeForCausalLM" if config.moe_config else qwen2_architecture(config)


QWEN2_HF = HFMapping(
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM", "SmolLM3ForCausalLM", "Qwen2MoeForCausalLM"),
    config_from_hf=_qwen2_from_hf,
    config_to_hf=_qwen2_to_hf,
    state_dict_from_hf=hf_state_dict_to_ours_full,
    state_dict_to_hf=our_full_state_dict_to_hf,
    model_types=("qwen2", "smollm3", "qwen2_moe"),
    architecture_of=_qwen2_architecture,
)
