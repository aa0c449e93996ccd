"""Hugging Face `transformers` Llama interop: configs and state dicts, both ways, for any tp.

`transformers` is optional (the `hf` extra) and only imported by `config_to_hf`. HF keeps q, k,
v, gate and up as separate matrices; we fuse them ([q; k; v] and [gate; up]) and shard each
section over tp. Both use the rotate-half RoPE layout, so no q/k permutation is needed.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import LlamaConfig, ModelConfigError
from .init import llama_init_spec
from .materialise import shard_full_tensors
from .moe.config import moe_layers_of
from .moe.hf_weights import moe_mlp_from_hf, moe_mlp_to_hf


class HFConversionError(ValueError):
    """A state dict that does not fit the config (a missing or unexpected tensor)."""


_LAYER_NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm"}


def config_from_hf(hf_config: Any) -> LlamaConfig:
    """Our LlamaConfig from a `transformers.LlamaConfig` (v4 or v5 field layout)."""
    get = (
        hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    )
    rope = get("rope_parameters") or {}
    theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    legacy_scaling = get("rope_scaling") or None
    kind = rope.get("rope_type", "default") if rope else None
    scaling = None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {"rope_type": "llama3", **{k: rope[k] for k in keys}}
    elif kind not in (None, "default"):
        raise ModelConfigError(f"rope_parameters.rope_type {kind!r} is not supported (only llama3)")
    elif legacy_scaling is not None and not rope:  # v5 aliases rope_scaling to rope_parameters
        scaling = dict(legacy_scaling)
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim")
    if head_dim not in (None, hidden // heads):
        raise ModelConfigError(
            f"head_dim={head_dim} != hidden_size/num_attention_heads is not supported"
        )
    if get("mlp_bias"):
        raise ModelConfigError("mlp_bias=True is not supported")
    eos = get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads"),
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=get("rms_norm_eps"),
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        hidden_act=get("hidden_act", "silu"),
        initializer_range=get("initializer_range", 0.02),
        bos_token_id=get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=get("pad_token_id"),
        attention_bias=bool(get("attention_bias", False)),
    )


def import_transformers():
    """transformers, or one line saying which extra installs it."""
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ModelConfigError(
            "converting to Hugging Face needs transformers: pip install 'nanotron-models[hf]'"
        ) from err
    return transformers


def shared_hf_config_fields(config: LlamaConfig) -> dict[str, Any]:
    """The keys a Hugging Face Llama-like config (Llama, Mixtral) takes from ours alike."""
    scaling = None
    if config.rope_scaling is not None:
        scaling = {k: v for k, v in config.rope_scaling.items() if k != "type"}
        scaling["rope_type"] = "llama3"
    return dict(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings=config.tie_word_embeddings,
        hidden_act=config.hidden_act,
        initializer_range=config.initializer_range,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def config_to_hf(config: LlamaConfig) -> Any:
    """A `transformers.LlamaConfig` describing the same model (needs the `hf` extra)."""
    return import_transformers().LlamaConfig(
        **shared_hf_config_fields(config),
        intermediate_size=config.intermediate_size,
        attention_bias=config.attention_bias,
        mlp_bias=False,
    )


def hf_state_dict_to_ours_full(hf_sd: dict[str, torch.Tensor], config: LlamaConfig) -> dict:
    """HF names/layout -> our global names, full (unsharded, unpadded) tensors."""
    out: dict[str, torch.Tensor] = {}
    moe = moe_layers_of(config)

    def take(key: str) -> torch.Tensor:
        if key not in hf_sd:
            raise HFConversionError(f"Hugging Face state dict has no {key!r}")
        return hf_sd[key]

    out["embedding.weight"] = take("model.embed_tokens.weight")
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"decoder.{i}"
        for hf_norm, our_norm in _LAYER_NORMS.items():
            out[f"{ours}.{our_norm}.weight"] = take(f"{hf}.{hf_norm}.weight")
        qkv = [take(f"{hf}.self_attn.{p}_proj.weight") for p in "qkv"]
        out[f"{ours}.attn.qkv.weight"] = torch.cat(qkv, dim=0)
        out[f"{ours}.attn.o_proj.weight"] = take(f"{hf}.self_attn.o_proj.weight")
        if config.attention_bias:
            biases = [take(f"{hf}.self_attn.{p}_proj.bias") for p in "qkv"]
            out[f"{ours}.attn.qkv.bias"] = torch.cat(biases, dim=0)
        if config.o_proj_bias:
            out[f"{ours}.attn.o_proj.bias"] = take(f"{hf}.self_attn.o_proj.bias")
        if i in moe:
            out.update(moe_mlp_from_hf(take, hf_sd.__contains__, hf, ours, config))
            continue
        gate_up = [take(f"{hf}.mlp.{p}_proj.weight") for p in ("gate", "up")]
        out[f"{ours}.mlp.gate_up.weight"] = torch.cat(gate_up, dim=0)
        out[f"{ours}.mlp.down.weight"] = take(f"{hf}.mlp.down_proj.weight")
    out["final_norm.weight"] = take("model.norm.weight")
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["embedding.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    return out


def shard_full_state_dict(
    full_sd: dict[str, torch.Tensor], config: LlamaConfig, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """Our full (unpadded or padded) tensors -> this tp rank's shards, vocab padded for tp."""
    return shard_full_tensors(full_sd, config, llama_init_spec, tp_rank, tp_size)


def hf_state_dict_to_ours(
    hf_sd: dict[str, torch.Tensor], config: LlamaConfig, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """HF state dict -> the state dict of our model's tp shard `tp_rank` (all blocks).

    Load it into a stage with `stage.load_state_dict(sd, strict=False)` (a pipeline stage only
    holds some of the names) or use `LlamaStage.load_full_state_dict`.
    """
    return shard_full_state_dict(
        hf_state_dict_to_ours_full(hf_sd, config), config, tp_rank, tp_size
    )


def our_full_state_dict_to_hf(
    full_sd: dict[str, torch.Tensor], config: LlamaConfig
) -> dict[str, torch.Tensor]:
    """Our full (gathered over tp, padded or not) state dict -> HF names and layout."""
    c = config
    d = c.head_dim
    q, kv = c.num_attention_heads * d, c.n_kv_heads * d
    moe = moe_layers_of(config)
    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = full_sd["embedding.weight"][: c.vocab_size]
    for i in range(c.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"decoder.{i}"
        qw, kw, vw = torch.split(full_sd[f"{ours}.attn.qkv.weight"], [q, kv, kv], dim=0)
        out[f"{hf}.self_attn.q_proj.weight"] = qw
        out[f"{hf}.self_attn.k_proj.weight"] = kw
        out[f"{hf}.self_attn.v_proj.weight"] = vw
        out[f"{hf}.self_attn.o_proj.weight"] = full_sd[f"{ours}.attn.o_proj.weight"]
        if c.attention_bias:
            qb, kb, vb = torch.split(full_sd[f"{ours}.attn.qkv.bias"], [q, kv, kv], dim=0)
            out[f"{hf}.self_attn.q_proj.bias"] = qb
            out[f"{hf}.self_attn.k_proj.bias"] = kb
            out[f"{hf}.self_attn.v_proj.bias"] = vb
        if c.o_proj_bias:
            out[f"{hf}.self_attn.o_proj.bias"] = full_sd[f"{ours}.attn.o_proj.bias"]
        if i in moe:
            out.update(moe_mlp_to_hf(full_sd, hf, ours, c))
        else:
            gate, up = torch.chunk(full_sd[f"{ours}.mlp.gate_up.weight"], 2, dim=0)
            out[f"{hf}.mlp.gate_proj.weight"] = gate
            out[f"{hf}.mlp.up_proj.weight"] = up
            out[f"{hf}.mlp.down_proj.weight"] = full_sd[f"{ours}.mlp.down.weight"]
        for hf_norm, our_norm in _LAYER_NORMS.items():
            out[f"{hf}.{hf_norm}.weight"] = full_sd[f"{ours}.{our_norm}.weight"]
    out["model.norm.weight"] = full_sd["final_norm.weight"]
    lm = full_sd.get("lm_head.weight", full_sd["embedding.weight"])
    out["lm_head.weight"] = (
        out["model.embed_tokens.weight"] if c.tie_word_embeddings else lm[: c.vocab_size]
    )
    return {k: v.contiguous() for k, v in out.items()}
