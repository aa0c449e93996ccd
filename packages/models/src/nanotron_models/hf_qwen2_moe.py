"""Hugging Face interop of Qwen2 with `moe_config`: `Qwen2MoeForCausalLM` (model_type
qwen2_moe), configs and state dicts both ways.

Layers: HF makes layer i sparse unless it is in `mlp_only_layers` or (i + 1) is not a multiple
of `decoder_sparse_step`; ours are `moe_config.layers`. Reading takes HF's set whatever its
spelling; writing spells it as `mlp_only_layers` with a step of 1.

Weights (moe/hf_weights.py, used by hf.py's state-dict conversion): HF's router is `mlp.gate.weight` [E, H] (ours `mlp.router.weight`). Its experts come
either fused, as a transformers 5 model holds them (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), or per expert, as checkpoints on the Hub store them and
transformers writes them (`mlp.experts.<j>.{gate,up,down}_proj.weight`); both are read, the
per-expert layout is written. Ours are stacked the other way round ([E, H, 2I] and [E, I, H]:
rows are tokens in the grouped matmul), so each is transposed. HF always has a shared expert
with its sigmoid gate: a model without one is written with a shared expert of size 0.

Not expressible in HF (refused in one line): the sigmoid_bias router, NoPE layers.
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfigError
from .hf import import_transformers
from .hf_qwen2 import _getter, _window, decoder_fields_from_hf, hf_decoder_kwargs
from .moe.config import MoEConfig
from .qwen2 import Qwen2Config


def qwen2_moe_config_from_hf(hf_config: Any) -> Qwen2Config:
    """Our Qwen2Config with moe_config from a transformers Qwen2MoeConfig (object or dict)."""
    get = _getter(hf_config)
    layers = get("num_hidden_layers")
    step = get("decoder_sparse_step") or 1
    dense = set(get("mlp_only_layers") or [])
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if not sparse or not get("num_experts"):
        raise ModelConfigError("qwen2_moe config has no sparse layer: convert it as qwen2")
    shared = get("shared_expert_intermediate_size") or 0
    config = Qwen2Config(
        **decoder_fields_from_hf(get),
        attention_bias=bool(get("qkv_bias", True)),
        moe_config=MoEConfig(
            num_experts=get("num_experts"),
            top_k=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            shared_expert_intermediate_size=shared if shared else 5632,
            enable_shared_expert=bool(shared),
            router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)),
            norm_topk_prob=bool(get("norm_topk_prob", False)),
            layers=[-1] if len(sparse) == layers else sparse,
        ),
    )
    _window(get, config)
    return config


def qwen2_moe_config_to_hf(config: Qwen2Config) -> Any:
    """A transformers Qwen2MoeConfig of the same model."""
    transformers = import_transformers()
    c, m = config, config.moe_config
    if m.router != "softmax":
        raise ModelConfigError(
            f"model_config.moe_config.router {m.router!r} has no Hugging Face Qwen2-MoE "
            "equivalent (its router is softmax top-k)"
        )
    if c.no_rope_layer is not None:
        raise ModelConfigError("model_config.no_rope_layer: Qwen2-MoE has no NoPE layers")
    layers = c.num_hidden_layers
    moe = set(m.moe_layers(layers))
    window = c.sliding_window_size
    return transformers.Qwen2MoeConfig(
        **hf_decoder_kwargs(c),
        qkv_bias=c.attention_bias,
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=layers,
        layer_types=["sliding_attention" if window else "full_attention"] * layers,
        num_experts=m.num_experts,
        num_experts_per_tok=m.top_k,
        moe_intermediate_size=m.moe_intermediate_size,
        shared_expert_intermediate_size=(
            m.shared_expert_intermediate_size if m.enable_shared_expert else 0
        ),
        norm_topk_prob=m.norm_topk_prob,
        router_aux_loss_coef=m.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if i not in moe],
    )
