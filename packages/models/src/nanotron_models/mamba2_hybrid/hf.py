"""Hugging Face interop of the Mamba-2 / hybrid family, both ways: `Mamba2ForCausalLM` (no
pattern: every layer Mamba-2) and `NemotronHForCausalLM` (a `hybrid_override_pattern`).

Names: HF's mixer names are ours (`backbone.layers.{i}.mixer.*` <-> `decoder.{i}.mixer.*`)
but for attention's q/k/v (fused into our `qkv`) and the MLP's `up_proj`/`down_proj`
(`up`/`down`). Nemotron-H's Mamba-2 clamps dt from below at `time_step_min`: our
`time_step_limit` (time_step_min, inf). An `E` layer's router is HF's `gate` (its
`e_score_correction_bias` our `router.expert_bias`), its shared expert `shared_experts`; the
experts are written per expert as the Hub stores them (`experts.{j}.up_proj.weight`, which
transformers 5 fuses on load) and read either way. HF Mamba2's `residual_in_fp32` (the default) is read as
false: the same model in float32, the residual stream in model.dtype otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import ModelConfigError
from .config import Mamba2HybridConfig

_COMMON = ("vocab_size", "hidden_size", "n_groups", "conv_kernel", "chunk_size", "use_conv_bias",
           "use_bias", "layer_norm_epsilon", "time_step_min", "time_step_max", "time_step_floor",
           "initializer_range", "tie_word_embeddings", "bos_token_id", "eos_token_id",
           "pad_token_id")  # fmt: skip


def _get(hf: Any, key: str, default: Any = None) -> Any:
    return hf.get(key, default) if isinstance(hf, dict) else getattr(hf, key, default)


# NemotronH's older config.json spellings (its own __post_init__ reads them the same way)
_NEMOTRON_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
                     "mamba_expand": "expand", "mamba_dt_min": "time_step_min",
                     "mamba_dt_max": "time_step_max", "mamba_conv_bias": "use_conv_bias",
                     "mamba_chunk_size": "chunk_size", "mamba_dt_init_floor": "time_step_floor"}  # fmt: skip
_LAYER_TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
                "mlp": "-", "moe": "E"}  # fmt: skip


def _limit(value: Any) -> tuple[float, float | None]:
    """HF's time_step_limit (a config.json writes inf as {"__float__": "Infinity"}); inf -> None."""
    out = []
    for x in value:
        x = float(x["__float__"]) if isinstance(x, dict) else float(x)
        out.append(None if math.isinf(x) else x)
    return tuple(out)


def _pattern(hf: Any) -> str:
    pattern = _get(hf, "hybrid_override_pattern")
    if pattern:
        return pattern
    kinds = _get(hf, "layers_block_type") or _get(hf, "layer_types") or []
    return "".join(_LAYER_TYPES.get(k, "?") for k in kinds)


# NemotronHConfig's `E` keys, ours alike (NemotronHConfig.attribute_map: num_local_experts)
_MOE = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
        "moe_shared_expert_intermediate_size", "n_group", "topk_group", "norm_topk_prob",
        "routed_scaling_factor", "moe_latent_size")  # fmt: skip


def _ids(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


def config_from_hf(hf: Any) -> Mamba2HybridConfig:
    """Our config from a transformers Mamba2Config / NemotronHConfig (or config.json dict)."""
    if isinstance(hf, dict):
        hf = {**{new: hf[old] for old, new in _NEMOTRON_ALIASES.items() if old in hf}, **hf}
    kw = {k: _get(hf, k) for k in _COMMON if _get(hf, k) is not None}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        kw[k] = _ids(kw.get(k))
    if _get(hf, "model_type") == "nemotron_h":
        heads, head_dim = _get(hf, "mamba_num_heads"), _get(hf, "mamba_head_dim")
        inner, hidden = heads * head_dim, _get(hf, "hidden_size")
        if inner % hidden or _get(hf, "mlp_hidden_act", "relu2") != "relu2":
            raise ModelConfigError("NemotronH: mamba_num_heads * mamba_head_dim must be a multiple "
                                   "of hidden_size, and mlp_hidden_act relu2")  # fmt: skip
        pattern = _pattern(hf)
        kw.update(
            {k: _get(hf, k) for k in _MOE if _get(hf, k) is not None or k == "moe_latent_size"}
        )
        return Mamba2HybridConfig(
            **kw, num_hidden_layers=len(pattern), hybrid_override_pattern=pattern,
            num_heads=heads, head_dim=head_dim, state_size=_get(hf, "ssm_state_size"),
            expand=inner // hidden, time_step_limit=(_get(hf, "time_step_min"), None),
            num_attention_heads=_get(hf, "num_attention_heads"),
            num_key_value_heads=_get(hf, "num_key_value_heads"),
            attention_head_dim=_get(hf, "head_dim"), intermediate_size=_get(hf, "intermediate_size"),
            mlp_bias=bool(_get(hf, "mlp_bias")),
            max_position_embeddings=_get(hf, "max_position_embeddings", 4096),
        )  # fmt: skip
    if _get(hf, "hidden_act", "silu") != "silu":
        raise ModelConfigError(f"Mamba2: hidden_act {_get(hf, 'hidden_act')!r} (only silu)")
    return Mamba2HybridConfig(
        **kw, num_hidden_layers=_get(hf, "num_hidden_layers"), num_heads=_get(hf, "num_heads"),
        head_dim=_get(hf, "head_dim"), state_size=_get(hf, "state_size"),
        expand=_get(hf, "expand"), time_step_limit=_limit(_get(hf, "time_step_limit")),
        rms_norm=bool(_get(hf, "rms_norm", True)),
    )  # fmt: skip


def config_to_hf(c: Mamba2HybridConfig) -> Any:
    """A transformers Mamba2Config (no pattern) or NemotronHConfig describing the same model."""
    import transformers

    kw = {k: getattr(c, k) for k in _COMMON}
    if c.hybrid_override_pattern is None:
        return transformers.Mamba2Config(
            **kw, num_hidden_layers=c.num_hidden_layers, num_heads=c.num_heads,
            head_dim=c.head_dim, state_size=c.state_size, expand=c.expand,
            time_step_limit=c.dt_limits, residual_in_fp32=False,
        )  # fmt: skip
    if c.time_step_limit != (c.time_step_min, None):
        raise ModelConfigError(
            "model_config.time_step_limit must be [time_step_min, null] for NemotronH "
            f"(its Mamba-2 clamps dt there), got {list(c.time_step_limit)}"
        )
    if c.attention_bias:
        raise ModelConfigError("model_config.attention_bias: NemotronH's attention has no bias")
    return transformers.NemotronHConfig(
        **kw, hybrid_override_pattern=c.pattern, mamba_num_heads=c.num_heads,
        mamba_head_dim=c.head_dim, ssm_state_size=c.state_size, expand=c.expand,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.attn_head_dim, intermediate_size=c.intermediate_size, mlp_hidden_act="relu2",
        mlp_bias=c.mlp_bias, max_position_embeddings=c.max_position_embeddings,
        **{k: getattr(c, k) for k in _MOE},
    )  # fmt: skip


def architecture(c: Mamba2HybridConfig) -> str:
    return "Mamba2ForCausalLM" if c.hybrid_override_pattern is None else "NemotronHForCausalLM"


# Both write `backbone.` (the Hub's files, what save_pretrained writes); an in-memory
# NemotronH names it `model.`, read as well.
PREFIX = "backbone"


def _layer_names(c: Mamba2HybridConfig, i: int) -> dict[str, str]:
    """Our names inside layer i -> HF's (q/k/v handled apart)."""
    kind = c.layer_kind(i)
    if kind == "M":
        leaves = ["in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight",
                  "out_proj.weight"]  # fmt: skip
        leaves += ["conv1d.bias"] * c.use_conv_bias + ["in_proj.bias", "out_proj.bias"] * c.use_bias
        names = {f"mixer.{x}": f"mixer.{x}" for x in leaves}
    elif kind == "*":
        names = {"mixer.o_proj.weight": "mixer.o_proj.weight"}
    elif kind == "E":  # the routed experts apart (_experts_*)
        names = {"mixer.router.weight": "mixer.gate.weight"}
        names.update({f"mixer.shared_expert.{o}.{k}": f"mixer.shared_experts.{o}_proj.{k}"
                      for o in ("up", "down") for k in ("weight", "bias")[: 1 + c.mlp_bias]})  # fmt: skip
    else:
        names = {f"mixer.{o}.{k}": f"mixer.{o}_proj.{k}" for o in ("up", "down")
                 for k in ("weight", "bias")[: 1 + c.mlp_bias]}  # fmt: skip
    return {"norm.weight": "norm.weight", **names}


def _qkv_sizes(c: Mamba2HybridConfig) -> list[int]:
    a = c.attention_view()
    return [a.num_attention_heads * a.head_dim] + [a.n_kv_heads * a.head_dim] * 2


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], c: Mamba2HybridConfig) -> dict:
    """HF names -> our global names, full tensors."""
    p = PREFIX if f"{PREFIX}.embeddings.weight" in hf_sd else "model"

    def take(key: str) -> torch.Tensor:
        if key not in hf_sd:
            raise ModelConfigError(f"Hugging Face state dict has no {key!r}")
        return hf_sd[key]

    out = {"embedding.weight": take(f"{p}.embeddings.weight"),
           "final_norm.weight": take(f"{p}.norm_f.weight")}  # fmt: skip
    for i in range(c.num_hidden_layers):
        hf = f"{p}.layers.{i}"
        for ours, theirs in _layer_names(c, i).items():
            out[f"decoder.{i}.{ours}"] = take(f"{hf}.{theirs}")
        if c.layer_kind(i) == "*":
            qkv = [take(f"{hf}.mixer.{x}_proj.weight") for x in "qkv"]
            out[f"decoder.{i}.mixer.qkv.weight"] = torch.cat(qkv, dim=0)
        elif c.layer_kind(i) == "E":
            out.update(_experts_from_hf(hf_sd, take, f"{hf}.mixer", f"decoder.{i}.mixer", c))
    out["lm_head.weight"] = (
        out["embedding.weight"] if c.tie_word_embeddings else take("lm_head.weight")
    )
    return out


def state_dict_to_hf(full_sd: dict[str, torch.Tensor], c: Mamba2HybridConfig) -> dict:
    """Our full state dict (padded or not) -> HF names."""
    p, v = PREFIX, c.vocab_size
    out = {f"{p}.embeddings.weight": full_sd["embedding.weight"][:v],
           f"{p}.norm_f.weight": full_sd["final_norm.weight"]}  # fmt: skip
    for i in range(c.num_hidden_layers):
        hf = f"{p}.layers.{i}"
        for ours, theirs in _layer_names(c, i).items():
            out[f"{hf}.{theirs}"] = full_sd[f"decoder.{i}.{ours}"]
        if c.layer_kind(i) == "*":
            parts = torch.split(full_sd[f"decoder.{i}.mixer.qkv.weight"], _qkv_sizes(c), dim=0)
            out.update({f"{hf}.mixer.{x}_proj.weight": t for x, t in zip("qkv", parts)})
        elif c.layer_kind(i) == "E":
            out.update(_experts_to_hf(full_sd, f"{hf}.mixer", f"decoder.{i}.mixer", c))
    lm_head = full_sd.get("lm_head.weight", full_sd["embedding.weight"])
    out["lm_head.weight"] = lm_head[:v]
    return out


def _experts_from_hf(hf_sd: dict, take, hf: str, ours: str, c: Mamba2HybridConfig) -> dict:
    """An `E` layer's routed experts (fused [E, out, in] as transformers 5 holds them, or per
    expert as the Hub) as ours [E, in, out], and the router's score-correction bias."""
    out = {}
    for proj in ("up_proj", "down_proj"):
        if f"{hf}.experts.{proj}" in hf_sd:
            fused = take(f"{hf}.experts.{proj}")
        else:
            fused = torch.stack(
                [take(f"{hf}.experts.{j}.{proj}.weight") for j in range(c.n_routed_experts)]
            )
        out[f"{ours}.experts.{proj}"] = fused.transpose(1, 2).contiguous()
    bias = hf_sd.get(f"{hf}.gate.e_score_correction_bias")
    out[f"{ours}.router.expert_bias"] = (
        torch.zeros(c.n_routed_experts) if bias is None else bias.float()
    )
    return out


def _experts_to_hf(full_sd: dict, hf: str, ours: str, c: Mamba2HybridConfig) -> dict:
    """The inverse, per expert (the Hub's layout); a missing bias (a stage's parameters only)
    is written as zeros, its initial value."""
    out = {}
    for proj in ("up_proj", "down_proj"):
        weights = full_sd[f"{ours}.experts.{proj}"].transpose(1, 2)  # [E, out, in]
        out.update({f"{hf}.experts.{j}.{proj}.weight": w.contiguous()
                    for j, w in enumerate(weights)})  # fmt: skip
    bias = full_sd.get(f"{ours}.router.expert_bias")
    out[f"{hf}.gate.e_score_correction_bias"] = (
        torch.zeros(c.n_routed_experts) if bias is None else bias
    )
    return out
