"""Hugging Face interop of the Qwen3-Next family, both ways: `Qwen3NextForCausalLM`.

Config: HF's keys are ours (config.py), but its rope: `rope_parameters` {rope_theta,
partial_rotary_factor, rope_type default} (or, in older config.json files, the top-level
`rope_theta` / `partial_rotary_factor`); other rope types are refused in one line.

Names: `model.layers.{i}` <-> `decoder.{i}`: input_layernorm / post_attention_layernorm are our
`input_norm` / `post_attn_norm`; `linear_attn.*` our Gated DeltaNet `mixer.*` (same names);
`self_attn.{q,k,v}_proj` fused into our `mixer.qkv` (q_proj's rows, each head's query then
gate, kept as they are), `o_proj`, `q_norm`, `k_norm` the same; a dense `mlp.{gate,up}_proj`
fused into `mlp.gate_up`, `down_proj` is `down`; a sparse `mlp.*` our MoE block's
(moe/hf_weights.py: the fused transformers-5 experts or the Hub's per-expert tensors read,
the per-expert layout written).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfigError
from ..moe.hf_weights import moe_mlp_from_hf, moe_mlp_to_hf
from .config import Qwen3NextConfig

_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
         "max_position_embeddings", "initializer_range", "rms_norm_eps", "tie_word_embeddings",
         "attention_bias", "linear_conv_kernel_dim", "linear_key_head_dim",
         "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
         "decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size",
         "num_experts_per_tok", "num_experts", "norm_topk_prob", "router_aux_loss_coef",
         "mlp_only_layers", "layer_types", "bos_token_id", "eos_token_id",
         "pad_token_id")  # fmt: skip


def _get(hf: Any, key: str, default: Any = None) -> Any:
    value = hf.get(key, default) if isinstance(hf, dict) else getattr(hf, key, default)
    return default if value is None else value


def config_from_hf(hf: Any) -> Qwen3NextConfig:
    """Our config from a transformers Qwen3NextConfig (or its config.json mapping)."""
    kw = {k: _get(hf, k) for k in _KEYS if _get(hf, k) is not None}
    if isinstance(kw.get("eos_token_id"), (list, tuple)):
        kw["eos_token_id"] = kw["eos_token_id"][0]
    rope = dict(_get(hf, "rope_parameters", None) or _get(hf, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelConfigError(
            f"Qwen3-Next rope_parameters.rope_type {rope.get('rope_type')!r}: only the default "
            "rotary embedding is supported"
        )
    theta = rope.get("rope_theta", _get(hf, "rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", _get(hf, "partial_rotary_factor", 0.25))
    if "layer_types" not in kw:
        kw["full_attention_interval"] = _get(hf, "full_attention_interval", 4)
    return Qwen3NextConfig(**kw, rope_theta=float(theta), partial_rotary_factor=float(factor))


def config_to_hf(c: Qwen3NextConfig) -> Any:
    """A transformers Qwen3NextConfig describing the same model."""
    import transformers

    kw = {k: getattr(c, k) for k in _KEYS}
    rope = {"rope_type": "default", "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.partial_rotary_factor}  # fmt: skip
    return transformers.Qwen3NextConfig(**kw, rope_parameters=rope)


def architecture(c: Qwen3NextConfig) -> str:
    return "Qwen3NextForCausalLM"


def _layer_names(c: Qwen3NextConfig, i: int) -> dict[str, str]:
    """Our names inside layer i -> HF's, for the tensors copied as they are."""
    names = {"input_norm.weight": "input_layernorm.weight",
             "post_attn_norm.weight": "post_attention_layernorm.weight"}  # fmt: skip
    if c.mixer_kind(i) == "G":
        leaves = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias",
                  "A_log", "norm.weight", "out_proj.weight")  # fmt: skip
        names.update({f"mixer.{x}": f"linear_attn.{x}" for x in leaves})
    else:
        leaves = ["o_proj.weight", "q_norm.weight", "k_norm.weight"]
        leaves += ["o_proj.bias"] * c.attention_bias
        names.update({f"mixer.{x}": f"self_attn.{x}" for x in leaves})
    if c.ffn_kind(i) == "-":
        names["mlp.down.weight"] = "mlp.down_proj.weight"
    return names


def _fused(c: Qwen3NextConfig, i: int) -> dict[str, tuple[list[str], list[int]]]:
    """Our fused tensors of layer i -> (HF's parts in order, their sizes along dim 0)."""
    d = c.head_dim
    q2, kv = 2 * c.num_attention_heads * d, c.num_key_value_heads * d
    out = {}
    if c.mixer_kind(i) == "*":
        for kind in ("weight", "bias")[: 1 + c.attention_bias]:
            parts = [f"self_attn.{x}_proj.{kind}" for x in "qkv"]
            out[f"mixer.qkv.{kind}"] = (parts, [q2, kv, kv])
    if c.ffn_kind(i) == "-":
        inter = c.intermediate_size
        out["mlp.gate_up.weight"] = (["mlp.gate_proj.weight", "mlp.up_proj.weight"], [inter] * 2)
    return out


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], c: Qwen3NextConfig) -> dict:
    """HF names -> our global names, full tensors."""

    def take(key: str) -> torch.Tensor:
        if key not in hf_sd:
            raise ModelConfigError(f"Hugging Face state dict has no {key!r}")
        return hf_sd[key]

    out = {"embedding.weight": take("model.embed_tokens.weight"),
           "final_norm.weight": take("model.norm.weight")}  # fmt: skip
    for i in range(c.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"decoder.{i}"
        for mine, theirs in _layer_names(c, i).items():
            out[f"{ours}.{mine}"] = take(f"{hf}.{theirs}")
        for mine, (parts, _) in _fused(c, i).items():
            out[f"{ours}.{mine}"] = torch.cat([take(f"{hf}.{p}") for p in parts], dim=0)
        if c.ffn_kind(i) == "E":
            out.update(moe_mlp_from_hf(take, hf_sd.__contains__, hf, ours, c))
    out["lm_head.weight"] = (
        out["embedding.weight"] if c.tie_word_embeddings else take("lm_head.weight")
    )
    return out


def state_dict_to_hf(full_sd: dict[str, torch.Tensor], c: Qwen3NextConfig) -> dict:
    """Our full state dict (padded or not) -> HF names (experts per expert, as the Hub's)."""
    v = c.vocab_size
    out = {"model.embed_tokens.weight": full_sd["embedding.weight"][:v],
           "model.norm.weight": full_sd["final_norm.weight"]}  # fmt: skip
    for i in range(c.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"decoder.{i}"
        for mine, theirs in _layer_names(c, i).items():
            out[f"{hf}.{theirs}"] = full_sd[f"{ours}.{mine}"]
        for mine, (parts, sizes) in _fused(c, i).items():
            pieces = torch.split(full_sd[f"{ours}.{mine}"], sizes, dim=0)
            out.update({f"{hf}.{p}": t for p, t in zip(parts, pieces, strict=True)})
        if c.ffn_kind(i) == "E":
            out.update(moe_mlp_to_hf(full_sd, hf, ours, c))
    out["lm_head.weight"] = full_sd.get("lm_head.weight", full_sd["embedding.weight"])[:v]
    return {k: t.contiguous() for k, t in out.items()}  # safetensors writes contiguous tensors
