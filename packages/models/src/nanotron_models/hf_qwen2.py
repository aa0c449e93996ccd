"""Hugging Face interop of the Qwen2 family: `Qwen2ForCausalLM` and `SmolLM3ForCausalLM`.

Both have Llama's parameter names, so the state dicts convert with hf.py's functions (our
Qwen2 has q, k, v biases when `attention_bias`, never an output bias). The configs differ:

- Qwen2 (`model_type: qwen2`) always has q/k/v biases: it maps to `attention_bias: true`;
  its sliding window must cover every layer (`layer_types` all `sliding_attention`).
- SmolLM3 (`model_type: smollm3`) has `no_rope_layers` (1 = RoPE, 0 = NoPE) and biases on
  q, k, v and o when `attention_bias` (refused: ours has no output bias); its NoPE layers
  must be every N-th (Nanotron's `no_rope_layer: N`) and its windowed layers exactly the
  RoPE layers (Nanotron's meaning: NoPE layers attend without a window).

`config_to_hf` writes a model with biases as Qwen2, one without as SmolLM3, with `layer_types`
spelled out so the windows land on the layers they are on here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import ModelConfigError
from .hf import import_transformers
from .qwen2 import Qwen2Config


def _getter(hf_config: Any):
    if isinstance(hf_config, dict):
        return hf_config.get
    return lambda k, d=None: getattr(hf_config, k, d)


def _rope(get) -> dict[str, Any]:
    """rope_theta and our scaling keys from HF's rope_parameters (v5) or rope_scaling (v4)."""
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta}
    if kind == "linear":
        return {"rope_theta": theta, "rope_seq_len_interpolation_factor": float(rope["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {
            "rope_theta": theta,
            "rope_scaling": {"rope_type": "llama3", **{k: rope[k] for k in keys}},
        }
    raise ModelConfigError(f"rope_type {kind!r} is not supported (default, linear or llama3)")


def _no_rope_layer(flags: list[int] | None, layers: int) -> int | None:
    """Nanotron's `no_rope_layer` N from SmolLM3's per-layer flags (None: RoPE everywhere)."""
    if not flags or all(flags):
        return None
    n = list(flags).index(0) + 1
    if [int((i + 1) % n != 0) for i in range(layers)] != [int(f) for f in flags]:
        raise ModelConfigError(
            f"no_rope_layers {list(flags)} is not 'every N-th layer has no RoPE' "
            "(Nanotron's no_rope_layer): not supported"
        )
    return n


def _window(get, config: Qwen2Config) -> int | None:
    """sliding_window_size, checked against the layers HF puts a window on."""
    if not get("use_sliding_window", False) or get("sliding_window") is None:
        return None
    window = int(get("sliding_window"))
    config.sliding_window_size = window
    expected = ["sliding_attention" if config.uses_rope(i) else "full_attention"
                for i in range(config.num_hidden_layers)]  # fmt: skip
    if list(get("layer_types") or expected) != expected:
        raise ModelConfigError(
            f"layer_types {get('layer_types')} put the sliding window on other layers than "
            "every RoPE layer (Nanotron's sliding_window_size): not supported"
        )
    return window


def decoder_fields_from_hf(get: Callable[..., Any]) -> dict[str, Any]:
    """Our Qwen2Config fields every Qwen2-like transformers config holds alike (sizes, norms,
    ids, rope); the inverse of `hf_decoder_kwargs`."""
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if get("head_dim") not in (None, hidden // heads):
        raise ModelConfigError("head_dim != hidden_size/num_attention_heads is not supported")
    eos = get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return dict(
        hidden_size=hidden,
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads"),
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=get("rms_norm_eps"),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        hidden_act=get("hidden_act", "silu"),
        initializer_range=get("initializer_range", 0.02),
        bos_token_id=get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=get("pad_token_id"),
        **_rope(get),
    )


def qwen2_config_from_hf(hf_config: Any) -> Qwen2Config:
    """Our Qwen2Config from a transformers Qwen2Config or SmolLM3Config (object or dict)."""
    get = _getter(hf_config)
    kind = get("model_type")
    if kind not in ("qwen2", "smollm3"):
        raise ModelConfigError(f"model_type {kind!r} is not qwen2 or smollm3")
    if get("mlp_bias"):
        raise ModelConfigError("mlp_bias=True is not supported")
    if kind == "smollm3" and get("attention_bias"):
        raise ModelConfigError(
            "SmolLM3 attention_bias=True puts a bias on o_proj, which Qwen2 here has not"
        )
    config = Qwen2Config(**decoder_fields_from_hf(get), attention_bias=kind == "qwen2")
    if kind == "smollm3":
        config.no_rope_layer = _no_rope_layer(get("no_rope_layers"), config.num_hidden_layers)
    _window(get, config)
    return config


def _hf_rope(config: Qwen2Config) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_seq_len_interpolation_factor is not None:
        params.update(rope_type="linear", factor=config.rope_seq_len_interpolation_factor)
    elif config.rope_scaling is not None:
        params.update({k: v for k, v in config.rope_scaling.items() if k != "type"})
        params["rope_type"] = "llama3"
    return params


def hf_decoder_kwargs(c: Qwen2Config) -> dict[str, Any]:
    """The transformers config fields every Qwen2-like class shares (sizes, rope, norms, ids)."""
    return dict(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=_hf_rope(c),
        tie_word_embeddings=c.tie_word_embeddings,
        hidden_act=c.hidden_act,
        initializer_range=c.initializer_range,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )


def qwen2_config_to_hf(config: Qwen2Config) -> Any:
    """A transformers Qwen2Config (attention_bias) or SmolLM3Config (no bias) of the same model."""
    transformers = import_transformers()
    c = config
    layers = c.num_hidden_layers
    window = c.sliding_window_size
    common = dict(
        **hf_decoder_kwargs(c),
        use_sliding_window=window is not None,
        sliding_window=window,
        layer_types=[
            "sliding_attention" if c.sliding_window(i) is not None else "full_attention"
            for i in range(layers)
        ],
    )
    if c.attention_bias:
        if c.no_rope_layer is not None:
            raise ModelConfigError(
                "model_config.no_rope_layer with attention_bias has no Hugging Face class "
                "(Qwen2 has no NoPE layers, SmolLM3's bias includes o_proj)"
            )
        return transformers.Qwen2Config(**common, max_window_layers=0)
    flags = [int(c.uses_rope(i)) for i in range(layers)]
    return transformers.SmolLM3Config(
        **common, no_rope_layers=flags, attention_bias=False, mlp_bias=False
    )


def qwen2_architecture(config: Qwen2Config) -> str:
    return "Qwen2ForCausalLM" if config.attention_bias else "SmolLM3ForCausalLM"
