"""Hugging Face interop of Llama with `moe_config`: `MixtralForCausalLM` (model_type mixtral),
configs and state dicts both ways.

Mixtral is Llama's decoder with every MLP a mixture of experts of `intermediate_size`: a
softmax router whose top-k weights are renormalised (ours: `router: softmax`,
`norm_topk_prob: true`) and no shared expert. A Llama whose experts differ (dense layers
among them, a shared expert, sigmoid or unnormalised routing) or with attention biases has no
Mixtral spelling, nor has a Mixtral with sliding windows or router jitter a Llama one: each is
refused in one line naming the key.

Weights: transformers 5 holds a Mixtral layer as it holds a Qwen2-MoE one (`mlp.gate.weight`,
`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); the Hub and
`save_pretrained` store it under `block_sparse_moe`, per expert: `experts.<j>.w1` (gate),
`w3` (up), `w2` (down), and `gate.weight`. Both are read, renamed to the Qwen2-MoE names
that hf.py converts (moe/hf_weights.py); the Hub's layout is written.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from .config import LlamaConfig, ModelConfigError
from .hf import (
    config_from_hf,
    hf_state_dict_to_ours_full,
    import_transformers,
    shared_hf_config_fields,
)
from .hf import our_full_state_dict_to_hf as _llama_to_hf
from .moe.config import MoEConfig

_MOE = "model_config.moe_config"
# The Hub's per-expert names -> transformers' Qwen2-MoE-style ones that hf.py reads.
_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HUB_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def mixtral_config_from_hf(hf_config: Any) -> LlamaConfig:
    """Our LlamaConfig with moe_config from a transformers MixtralConfig (object or dict)."""
    get = (
        hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    )
    if get("sliding_window") is not None:
        raise ModelConfigError(f"Mixtral's sliding_window={get('sliding_window')} is not supported")
    if get("router_jitter_noise"):
        raise ModelConfigError(
            f"Mixtral's router_jitter_noise={get('router_jitter_noise')} is not supported"
        )
    moe = MoEConfig(
        num_experts=get("num_local_experts"),
        top_k=get("num_experts_per_tok"),
        moe_intermediate_size=get("intermediate_size"),
        router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)),
        norm_topk_prob=True,  # Mixtral renormalises the top-k weights
    )
    return dataclasses.replace(config_from_hf(hf_config), moe_config=moe)


def _mixtral_error(config: LlamaConfig) -> str | None:
    """Why `config` has no Mixtral spelling (None: it has one)."""
    m = config.moe_config
    if m.moe_layers(config.num_hidden_layers) != list(range(config.num_hidden_layers)):
        return f"{_MOE}.layers {m.layers}: Mixtral's layers are all experts (layers: [-1])"
    if m.enable_shared_expert:
        return f"{_MOE}.enable_shared_expert: Mixtral has no shared expert"
    if m.router != "softmax" or not m.norm_topk_prob:
        return f"{_MOE}: Mixtral routes by softmax with norm_topk_prob: true"
    if config.attention_bias:
        return "model_config.attention_bias: Mixtral's attention has no biases"
    return None


def mixtral_config_to_hf(config: LlamaConfig) -> Any:
    """A `transformers.MixtralConfig` describing the same model (needs the `hf` extra)."""
    error = _mixtral_error(config)
    if error is not None:
        raise ModelConfigError(f"{error}, so it cannot be written as a Hugging Face Mixtral")
    m = config.moe_config
    return import_transformers().MixtralConfig(
        **shared_hf_config_fields(config),
        intermediate_size=m.moe_intermediate_size,
        num_local_experts=m.num_experts,
        num_experts_per_tok=m.top_k,
        router_aux_loss_coef=m.router_aux_loss_coef,
        sliding_window=None,
    )


def mixtral_state_dict_from_hf(hf_sd: dict[str, torch.Tensor], config: LlamaConfig) -> dict:
    """Full tensors under our names from a Mixtral state dict (transformers' or the Hub's)."""
    renamed = {}
    for key, tensor in hf_sd.items():
        hub = _HUB_EXPERT.search(key)
        if hub:
            key = f"{key[: hub.start()]}.mlp.experts.{hub[1]}.{_EXPERT[hub[2]]}.weight"
        renamed[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
    return hf_state_dict_to_ours_full(renamed, config)


def mixtral_state_dict_to_hf(full_sd: dict[str, torch.Tensor], config: LlamaConfig) -> dict:
    """Our full tensors under the Hub's Mixtral names (`block_sparse_moe`, w1 / w3 / w2)."""
    names = {v: k for k, v in _EXPERT.items()}
    out = {}
    for key, tensor in _llama_to_hf(full_sd, config).items():
        if ".mlp.shared_expert" in key:
            continue  # written by the Qwen2-MoE layout, of size 0: Mixtral has none
        match = re.search(r"\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$", key)
        if match:
            key = (
                f"{key[: match.start()]}.mlp.experts.{match[1]}.{names[match[2] + '_proj']}.weight"
            )
        out[
            key.replace(".mlp.gate.", ".block_sparse_moe.gate.").replace(
                ".mlp.experts.", ".block_sparse_moe.experts."
            )
        ] = tensor
    return out
