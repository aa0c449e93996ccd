"""Parameter count, training FLOPs per token, and per-block forward costs for pipeline placement."""

from __future__ import annotations

from dataclasses import dataclass

from .config import LlamaConfig
from .moe.config import moe_layers_of


def _mlp_params(c: LlamaConfig, layer: int, active: bool) -> int:
    """The feed-forward block's matmul weights: the dense SwiGLU, or a MoE layer's router,
    experts (`active`: the top_k a token runs through, else all of them), shared expert and
    its gate."""
    h = c.hidden_size
    if layer not in moe_layers_of(c):
        return 3 * h * c.intermediate_size  # gate, up, down
    m = c.moe_config
    experts = m.top_k if active else m.num_experts
    shared = 3 * h * m.shared_expert_intermediate_size + h if m.enable_shared_expert else 0
    return h * m.num_experts + experts * 3 * h * m.moe_intermediate_size + shared


def _layer_matmul_params(c: LlamaConfig, layer: int = 0, active: bool = True) -> int:
    d = c.head_dim
    qkv = c.hidden_size * (c.num_attention_heads + 2 * c.n_kv_heads) * d
    o_proj = c.num_attention_heads * d * c.hidden_size
    return qkv + o_proj + _mlp_params(c, layer, active)


def _layer_biases(c: LlamaConfig) -> int:
    if not c.attention_bias:
        return 0
    qkv = (c.num_attention_heads + 2 * c.n_kv_heads) * c.head_dim
    return qkv + (c.hidden_size if c.o_proj_bias else 0)


def num_parameters(config: LlamaConfig) -> int:
    """Trainable parameters of the unpadded model, a tied embedding counted once."""
    c = config
    # + two RMSNorm weights and the attention biases; every expert of a MoE layer
    layers = sum(
        _layer_matmul_params(c, i, active=False) + 2 * c.hidden_size + _layer_biases(c)
        for i in range(c.num_hidden_layers)
    )
    embedding = c.vocab_size * c.hidden_size
    lm_head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return embedding + layers + c.hidden_size + lm_head


def training_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Model FLOPs of one training step (forward + backward) per token:

        6 * N  +  12 * L * h * s

    N counts the weights that do a matrix multiply per token: every decoder layer's q, k, v, o,
    gate, up and down projections plus the lm_head (V x h, counted even when tied to the
    embedding, since the projection is computed either way). The embedding lookup and the norms
    are left out (no matmul). 6 = 2 FLOPs per multiply-add x (1 forward + 2 backward).
    The attention term is the PaLM / Megatron one: per token and layer, QK^T and AV take
    2 * 2 * h * s FLOPs forward, x3 for forward + backward = 12 * h * s, with the causal mask
    NOT halving it (the usual convention for MFU, so figures compare with published ones).

    Sliding windows: a layer with a window of W keys counts min(W, s) keys per token instead
    of s (the work a block-sparse kernel does; the same convention, causal mask not halved).
    Mixture-of-experts layers count their ACTIVE weights: the router, the top_k experts a
    token runs through and the shared expert with its gate (the work done per token, as
    MoE papers report MFU); `num_parameters` counts every expert.
    Document masking is not counted: how much it saves depends on each batch's documents
    (a packed batch of documents of length l does about l/s of the attention work), so the
    figure stays the full-sequence one and MFU is comparable across datasets
    (docs/models.md).
    """
    c = config
    layers = sum(_layer_matmul_params(c, i) for i in range(c.num_hidden_layers))
    n = layers + c.vocab_size * c.hidden_size
    return float(6 * n + 12 * c.hidden_size * attended_keys(c, seq_len))


def attended_keys(config: LlamaConfig, seq_len: int) -> int:
    """Keys per token summed over the layers, as the FLOPs count them: s per layer, or
    min(W, s) for a layer with a sliding window of W."""
    total = 0
    for layer in range(config.num_hidden_layers):
        window = config.sliding_window(layer)
        total += seq_len if window is None else min(window, seq_len)
    return total


def llama_block_names(config: LlamaConfig) -> list[str]:
    decoders = [f"decoder.{i}" for i in range(config.num_hidden_layers)]
    return ["embedding", *decoders, "final_norm", "lm_head", "loss"]


def llama_block_costs(config: LlamaConfig, seq_len: int) -> list[float]:
    """Estimated forward FLOPs of each block for one sequence of `seq_len` tokens.

    Same order as `llama_block_names`. Only relative values matter (pipeline placement), but
    they are real FLOP counts: decoder = matmuls + causal-free attention, lm_head = 2*s*V*h.
    """
    c, s, h = config, seq_len, config.hidden_size
    embedding = float(s * h)  # a gather: memory-bound, tiny
    decoders = []
    for layer in range(c.num_hidden_layers):
        window = c.sliding_window(layer)
        keys = s if window is None else min(window, s)
        matmuls = _layer_matmul_params(c, layer)
        decoders.append(float(2 * s * matmuls + 4 * s * keys * h + 20 * s * h))
    final_norm = float(4 * s * h)
    lm_head = float(2 * s * c.vocab_size * h)
    loss = float(5 * s * c.vocab_size)  # softmax over the vocab
    return [embedding, *decoders, final_norm, lm_head, loss]


@dataclass(frozen=True)
class BlockSpec:
    name: str
    cost: float


def llama_block_specs(config: LlamaConfig, seq_len: int | None = None) -> list[BlockSpec]:
    """(name, forward cost) of every block; seq_len defaults to max_position_embeddings."""
    s = seq_len if seq_len is not None else config.max_position_embeddings
    names, costs = llama_block_names(config), llama_block_costs(config, s)
    return [BlockSpec(n, c) for n, c in zip(names, costs)]


def _moe_activation_elements(c: LlamaConfig, tp: int) -> int:
    """Saved elements per token of a MoE block: the routed copies of the token in and out
    (top_k of each, with their gate, up, silu and product), the router's logits,
    probabilities and top-k (about 6 per expert) and the shared expert's MLP."""
    m = c.moe_config
    routed = m.top_k * (2 * c.hidden_size + 4 * m.moe_intermediate_size) + 6 * m.num_experts
    shared = 4 * m.shared_expert_intermediate_size // tp if m.enable_shared_expert else 0
    return routed + shared


def llama_activation_elements(
    config: LlamaConfig, tp: int, sequence_parallel: bool
) -> tuple[tuple[int, ...], int]:
    """(saved elements per token of each decoder layer, of one layer's input) on a tp rank,
    for the memory check before allocation; `sequence_parallel`: REDUCE_SCATTER mode, where
    the residual stream holds 1/tp of the sequence. Counted from autograd's saved tensors of a
    layer (tests/train/test_plan_memory.py measures the layer's share of the peak: 2436 per
    token at hidden 128, as here)."""
    c = config
    h = c.hidden_size
    d = h // c.num_attention_heads
    hs = h // tp if sequence_parallel else h
    qkv = (c.num_attention_heads + 2 * c.n_kv_heads) * d // tp
    attn = c.num_attention_heads * d // tp
    # two norms' inputs and outputs, under sequence parallel the gathered inputs of the qkv
    # and gate/up linears; q, k, v once (rotated in place for attention), the attention's
    # output (o_proj's input) and its fp32 log-sum-exp per head; the MLP's or MoE's set
    gathered = 2 * h if sequence_parallel and tp > 1 else 0
    heads = c.num_attention_heads // tp
    mlp = 4 * c.intermediate_size // tp
    m = getattr(c, "moe_config", None)
    moe = set(m.moe_layers(c.num_hidden_layers)) if m is not None else set()
    ffn = [_moe_activation_elements(c, tp) if i in moe else mlp for i in range(c.num_hidden_layers)]
    return tuple(4 * hs + gathered + qkv + attn + heads + f for f in ffn), hs
