"""The Qwen3-Next family's parameters and sizes: tensor-parallel plan, init spec, block names
and costs, parameter count, FLOPs and activation memory.

Names: `embedding`, `decoder.{i}` (`input_norm`, `mixer`, `post_attn_norm`, `mlp`),
`final_norm`, `lm_head`, `loss`. A Gated DeltaNet mixer keeps HF's `linear_attn` names
(`in_proj_qkvz`, `in_proj_ba`, `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`); a gated
attention mixer is `qkv` ([q+gate | k | v]), `o_proj`, `q_norm`, `k_norm`; a dense MLP
`gate_up`, `down`; a sparse one our MoE block's (`router`, `experts.*`, `shared_expert.*`,
`shared_expert_gate`).

Tensor parallel: attention heads as Llama's (q with its gate, k, v cut part by part); the
Gated DeltaNet layer by key heads, each rank keeping whole key heads and their value heads:
in_proj_qkvz and in_proj_ba are laid out key head by key head in HF (so a rank's rows are one
block), the conv's channels [q | k | v] cut section by section, A_log and dt_bias by value
head, out_proj row-parallel; norms are replicated.

Muon: the head-major fused weights are several logical matrices each (`muon_parts`).
"""

from __future__ import annotations

import math

import torch

from ..init import InitSpec, moe_init_spec, param_seed
from ..tp_plan import Split, TPPlan
from .config import Qwen3NextConfig

TIED_KEY = "embedding.weight"
HEAD_PARAMS = ("A_log", "dt_bias")  # per value head of a Gated DeltaNet layer

QWEN3_NEXT_TP_PLAN = TPPlan(
    {
        "embedding": Split.VOCAB,
        "lm_head": Split.COLUMN,
        "mixer.qkv": Split.COLUMN,
        "mixer.o_proj": Split.ROW,
        "mixer.in_proj_qkvz": Split.COLUMN,
        "mixer.in_proj_ba": Split.COLUMN,
        "mixer.conv1d": Split.COLUMN,
        "mixer.out_proj": Split.ROW,
        "gate_up": Split.COLUMN,  # the dense MLP's and the shared expert's
        "down": Split.ROW,
    },
    parameters={f"mixer.{n}": 0 for n in HEAD_PARAMS},
)


def gdn_sizes(c: Qwen3NextConfig) -> dict[str, int]:
    """key_dim, value_dim, conv_dim, in_proj_qkvz's and in_proj_ba's rows (full model)."""
    key, value = (
        c.linear_num_key_heads * c.linear_key_head_dim,
        (c.linear_num_value_heads * c.linear_value_head_dim),
    )
    return {"key": key, "value": value, "conv": 2 * key + value, "qkvz": 2 * key + 2 * value,
            "ba": 2 * c.linear_num_value_heads}  # fmt: skip


def qwen3_next_init_spec(
    config: Qwen3NextConfig, name: str, init_std: float, tp: int,
    scaling_method: str = "NUM_LAYERS",
) -> InitSpec:  # fmt: skip
    """How parameter `name` is made (full shape, std) and cut over tp (the plan). HF's rules:
    linears normal(initializer_range), zero-centred norms 0, the gated norm 1, dt_bias 1,
    A_log log U(0.01, 16) (`fill_head_params`)."""
    c, h = config, config.hidden_size
    scaled = (
        init_std / math.sqrt(2 * c.num_hidden_layers)
        if scaling_method == "NUM_LAYERS"
        else init_std
    )
    split = QWEN3_NEXT_TP_PLAN.shard_dim(name)
    vpad = c.padded_vocab_size(tp)
    if name == "embedding.weight" or (name == "lm_head.weight" and c.tie_word_embeddings):
        return InitSpec(TIED_KEY, (c.vocab_size, h), init_std, split, pad_rows_to=vpad,
                        embedding=True)  # fmt: skip
    if name == "lm_head.weight":
        return InitSpec(name, (c.vocab_size, h), init_std, split, pad_rows_to=vpad,
                        fan=(h, c.vocab_size))  # fmt: skip
    if name.endswith("mixer.norm.weight"):  # the gated norm: ones, as HF's
        return InitSpec(name, (c.linear_value_head_dim,), None, split)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return InitSpec(name, (c.head_dim,), 0.0, split)
    if name.endswith("norm.weight"):  # zero-centred
        return InitSpec(name, (h,), 0.0, split)
    leaf = name.split(".mixer.", 1)[-1]
    if ".mixer." in name and leaf in HEAD_PARAMS:  # ones; A_log by `fill_head_params`
        return InitSpec(name, (c.linear_num_value_heads,), None, split)
    if ".mixer." in name:
        return _mixer_spec(c, name, leaf, init_std, scaled, split)
    inter = c.intermediate_size
    if name.endswith("mlp.gate_up.weight"):  # a dense layer's (not the shared expert's)
        return InitSpec(name, (2 * inter, h), init_std, split, (inter, inter), fan=(h, 2 * inter))
    if name.endswith("mlp.down.weight"):
        return InitSpec(name, (h, inter), scaled, split, fan=(inter, h))
    if ".mlp." in name and c.moe_config is not None:
        return moe_init_spec(c, name, init_std, scaled)
    raise KeyError(f"no initialisation rule for parameter {name!r}")


def _mixer_spec(c, name: str, leaf: str, std: float, scaled: float, split) -> InitSpec:
    h, d, g = c.hidden_size, c.head_dim, gdn_sizes(c)
    q2, kv = 2 * c.num_attention_heads * d, c.num_key_value_heads * d
    k = c.linear_conv_kernel_dim
    table = {
        "qkv.weight": ((q2 + 2 * kv, h), std, (q2, kv, kv)),
        "qkv.bias": ((q2 + 2 * kv,), 0.0, (q2, kv, kv)),
        "o_proj.weight": ((h, q2 // 2), scaled, None),
        "o_proj.bias": ((h,), 0.0, None),
        "in_proj_qkvz.weight": ((g["qkvz"], h), std, None),
        "in_proj_ba.weight": ((g["ba"], h), std, None),
        "conv1d.weight": ((g["conv"], 1, k), std, (g["key"], g["key"], g["value"])),
        "out_proj.weight": ((h, g["value"]), scaled, None),
    }
    if leaf not in table:
        raise KeyError(f"no initialisation rule for parameter {name!r}")
    shape, s, sections = table[leaf]
    fan = (shape[1], shape[0]) if leaf.endswith("proj.weight") or leaf == "qkv.weight" else None
    return InitSpec(name, shape, s, split, sections, fan=fan, interleaved=muon_parts(c).get(leaf))


def muon_parts(c: Qwen3NextConfig) -> dict[str, tuple[tuple[int, tuple[int, ...]], ...]]:
    """The head-major fused weights' logical matrices (ParamMeta.interleaved), which Muon
    orthogonalises apart as the Mamba-2 hybrid's in_proj sections: in_proj_qkvz's q, k, v and
    z and in_proj_ba's b and a, each gathered over the key heads (HF's rows are key head by
    key head), and the attention's query and output gate, gathered over the heads, with k
    and v."""
    d, dk, r = c.head_dim, c.linear_key_head_dim, gdn_heads_per_key(c)
    dv, kv = r * c.linear_value_head_dim, c.num_key_value_heads * d
    nk = c.linear_num_key_heads
    return {
        "in_proj_qkvz.weight": ((nk, (dk, dk, dv, dv)),),
        "in_proj_ba.weight": ((nk, (r, r)),),
        "qkv.weight": ((c.num_attention_heads, (d, d)), (1, (kv,)), (1, (kv,))),
    }


def gdn_heads_per_key(c: Qwen3NextConfig) -> int:
    """Value heads per key head of a Gated DeltaNet layer."""
    return c.linear_num_value_heads // c.linear_num_key_heads


@torch.no_grad()
def fill_head_params(stage: torch.nn.Module, config: Qwen3NextConfig, seed: int) -> None:
    """A_log as HF initialises it (log of U(0.01, 16) per value head), the full tensor drawn
    from a generator seeded by (seed, name) and each rank keeping its heads: the same in any
    layout."""
    for name, param in stage.named_parameters():
        if not name.endswith(".mixer.A_log"):
            continue
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        full = torch.empty(config.linear_num_value_heads).uniform_(0.01, 16, generator=gen).log()
        part = param.shape[0]
        rank = stage.pc.tp_rank if part < full.shape[0] else 0
        param.copy_(full[rank * part : (rank + 1) * part].to(param.dtype))


# ---- blocks, sizes and FLOPs ----------------------------------------------------------------


def qwen3_next_block_names(config: Qwen3NextConfig) -> list[str]:
    return ["embedding", *(f"decoder.{i}" for i in range(config.num_hidden_layers)),
            "final_norm", "lm_head", "loss"]  # fmt: skip


def _mixer_matmul_params(c: Qwen3NextConfig, layer: int) -> int:
    h = c.hidden_size
    if c.mixer_kind(layer) == "*":
        return h * (3 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    g = gdn_sizes(c)
    return h * (g["qkvz"] + g["ba"] + g["value"])


def _ffn_matmul_params(c: Qwen3NextConfig, layer: int, active: bool) -> int:
    """The feed-forward's matmul weights: all of them, or those one token uses (`active`)."""
    h = c.hidden_size
    if c.ffn_kind(layer) == "-":
        return 3 * h * c.intermediate_size
    experts = c.num_experts_per_tok if active else c.num_experts
    shared = c.shared_expert_intermediate_size
    return 3 * h * c.moe_intermediate_size * experts + 3 * h * shared + h * (c.num_experts + 1)


def _mixer_flops(c: Qwen3NextConfig, layer: int, s: int) -> float:
    """Forward FLOPs per token beyond the matmuls: the attention's scores (PaLM's 4 h s), or
    the chunked delta rule's (chunk-local q k^T, k k^T and their products with the values,
    the state read twice and written once) and the conv."""
    if c.mixer_kind(layer) == "*":
        return 4.0 * s * c.num_attention_heads * c.head_dim
    q, dk, dv = min(c.linear_chunk_size, s), c.linear_key_head_dim, c.linear_value_head_dim
    per_head = 4.0 * q * dk + 4.0 * q * dv + 6.0 * dk * dv
    return c.linear_num_value_heads * per_head + 2.0 * gdn_sizes(c)["conv"] * (
        c.linear_conv_kernel_dim
    )


def qwen3_next_block_costs(config: Qwen3NextConfig, seq_len: int) -> list[float]:
    """Forward FLOPs of each block for one sequence (pipeline placement by cost)."""
    c, s, h = config, seq_len, config.hidden_size
    layers = [
        float(s * (2 * (_mixer_matmul_params(c, i) + _ffn_matmul_params(c, i, True))
                   + _mixer_flops(c, i, s) + 20 * h))
        for i in range(c.num_hidden_layers)
    ]  # fmt: skip
    return [float(s * h), *layers, float(4 * s * h), float(2 * s * c.vocab_size * h),
            float(5 * s * c.vocab_size)]  # fmt: skip


def qwen3_next_training_flops_per_token(config: Qwen3NextConfig, seq_len: int) -> float:
    """6 N (the matmul weights a token uses, lm_head included) + 3 x the mixers' own FLOPs."""
    c = config
    n = sum(
        _mixer_matmul_params(c, i) + _ffn_matmul_params(c, i, True)
        for i in range(c.num_hidden_layers)
    )
    n += c.vocab_size * c.hidden_size
    return 6.0 * n + 3.0 * sum(_mixer_flops(c, i, seq_len) for i in range(c.num_hidden_layers))


def qwen3_next_num_parameters(config: Qwen3NextConfig) -> int:
    """Trainable parameters of the unpadded model (a tied embedding counted once)."""
    c, h = config, config.hidden_size
    total = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h
    for i in range(c.num_hidden_layers):
        total += 2 * h + _mixer_matmul_params(c, i) + _ffn_matmul_params(c, i, False)
        if c.mixer_kind(i) == "*":
            total += 2 * c.head_dim
            if c.attention_bias:
                total += (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim + h
        else:
            g = gdn_sizes(c)
            total += g["conv"] * c.linear_conv_kernel_dim + 2 * c.linear_num_value_heads
            total += c.linear_value_head_dim
    return total


def qwen3_next_activation_elements(
    config: Qwen3NextConfig, tp: int, sequence_parallel: bool
) -> tuple[tuple[int, ...], int]:
    """(saved elements per token of each layer, of a layer's input) on a tp rank: the memory
    model. Counted from autograd's saved tensors of each layer kind with the delta rule in
    PyTorch (the CPU's path): a layer's two norms, its mixer's and its feed-forward's sets.
    The gated attention saves q with its gate, k, v, their norms' inputs and outputs, the
    rotated q and k, the output and its fp32 log-sum-exp; the Gated DeltaNet its projections,
    the conv's input with its halo, output and activation, about eleven copies of the value
    width (the delta rule's normalised q, k, v, output, gate and norm), per chunk of c tokens
    the decay and triangular matrices (7 H_v c per token) and the chunk states
    (2 H_v d_k d_v / c per token); a MoE block the routed copies in and out with their
    gate, up, silu and product, the router's (about 8 per expert) and the shared expert, under
    sequence parallel for this rank's part of the sequence only (its MLP input not gathered)."""
    c, h = config, config.hidden_size
    hs = h // tp if sequence_parallel else h
    gathered = 2 * h if sequence_parallel and tp > 1 else 0  # the mixer's and MLP's inputs
    g = gdn_sizes(c)
    hd, heads, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    attn = (2 * (3 * heads + 2 * kv) + 2 * heads + kv) * hd + heads
    hv, chunk = c.linear_num_value_heads, c.linear_chunk_size
    delta = (
        2 * h + g["qkvz"] + g["ba"] + 3 * g["conv"] + 11 * g["value"] + 3 * g["key"] + 4 * hv
        + 7 * hv * chunk + 2 * hv * c.linear_key_head_dim * c.linear_value_head_dim // chunk
    )  # fmt: skip
    mixer = {"*": attn // tp, "G": delta // tp}
    dense = 4 * c.intermediate_size // tp
    sparse = (
        c.num_experts_per_tok * (2 * h + 4 * c.moe_intermediate_size) + 2 * h
        + 8 * c.num_experts + 4 * c.shared_expert_intermediate_size // tp
    )  # fmt: skip
    if sequence_parallel and tp > 1:  # the MoE block routes this rank's part of the sequence
        sparse = sparse // tp - h // tp
    return tuple(
        4 * hs + gathered + mixer[c.mixer_kind(i)] + (sparse if c.ffn_kind(i) == "E" else dense)
        for i in range(c.num_hidden_layers)
    ), hs
