"""The Mamba-2 / hybrid family's parameters and sizes: its tensor-parallel plan, init spec,
block names and costs, parameter count, FLOPs and activation memory.

Names: `embedding`, `decoder.{i}` (each `norm` + `mixer`), `final_norm`, `lm_head`, `loss`.
A Mamba-2 mixer keeps Hugging Face's names (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
`norm`, `out_proj`); an attention mixer is our attention (`qkv`, `o_proj`); an MLP `up`, `down`;
experts our MoE block's (`router.weight`, `router.expert_bias`, `experts.up_proj` [E, h, I],
`experts.down_proj` [E, I, h], `shared_expert.up` / `.down`): router and routed experts
replicated over tp (split over ep), the shared expert cut as the MLP.

Tensor parallel, Megatron's for Mamba-2 (mixers/mamba2_tp.py): a rank keeps H/tp heads and
G/tp groups, its block of EACH section of in_proj [z | x | B | C | dt] and of the conv's
channels [x | B | C] (the sections cut part by part, as q/k/v are), its heads' A_log, D,
dt_bias and gated-norm channels; out_proj is row-parallel (one all-reduce per layer).
"""

from __future__ import annotations

import math

import torch

from ..init import InitSpec, param_seed
from ..mixers import mamba2_ssm_init
from ..tp_plan import Split, TPPlan
from .config import Mamba2HybridConfig

TIED_KEY = "embedding.weight"
HEAD_PARAMS = ("A_log", "D", "dt_bias")  # per Mamba-2 head: initialised by HF's rule

MAMBA2_HYBRID_TP_PLAN = TPPlan(
    {
        "embedding": Split.VOCAB,
        "lm_head": Split.COLUMN,
        "mixer.in_proj": Split.COLUMN,
        "mixer.conv1d": Split.COLUMN,
        "mixer.norm": Split.COLUMN,
        "mixer.out_proj": Split.ROW,
        "mixer.qkv": Split.COLUMN,
        "mixer.o_proj": Split.ROW,
        "mixer.up": Split.COLUMN,
        "mixer.down": Split.ROW,
        "shared_expert.up": Split.COLUMN,  # an `E` layer's shared expert, as the MLP
        "shared_expert.down": Split.ROW,
    },
    parameters={f"mixer.{n}": 0 for n in HEAD_PARAMS},
)


def mamba_sections(c: Mamba2HybridConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(in_proj's output sections [z, x, B, C, dt], the conv's channel sections [x, B, C])."""
    d = c.mamba_dims
    gn = d.n_groups * d.state_size
    i = d.intermediate_size
    return (i, i, gn, gn, d.num_heads), (i, gn, gn)


def hybrid_init_spec(
    config: Mamba2HybridConfig, name: str, init_std: float, tp: int,
    scaling_method: str = "NUM_LAYERS",
) -> InitSpec:  # fmt: skip
    """How parameter `name` is made (full shape, std) and cut over tp (the plan)."""
    c, h = config, config.hidden_size
    scaled = (
        init_std / math.sqrt(2 * c.num_hidden_layers)
        if scaling_method == "NUM_LAYERS"
        else init_std
    )
    split = MAMBA2_HYBRID_TP_PLAN.shard_dim(name)
    vpad = c.padded_vocab_size(tp)
    if name == "embedding.weight" or (name == "lm_head.weight" and c.tie_word_embeddings):
        return InitSpec(TIED_KEY, (c.vocab_size, h), init_std, split, pad_rows_to=vpad,
                        embedding=True)  # fmt: skip
    if name == "lm_head.weight":
        return InitSpec(name, (c.vocab_size, h), init_std, split, pad_rows_to=vpad,
                        fan=(h, c.vocab_size))  # fmt: skip
    if name in ("final_norm.weight",) or name.endswith(".norm.weight"):
        size = c.mamba_dims.intermediate_size if name.endswith("mixer.norm.weight") else h
        return InitSpec(name, (size,), None, split)
    leaf = name.split(".mixer.", 1)[-1]
    if leaf in HEAD_PARAMS:  # placeholder ones; `fill_head_params` writes HF's values
        return InitSpec(name, (c.num_heads,), None, split)
    if leaf.startswith(("in_proj", "conv1d", "out_proj")):
        return _mamba_spec(c, name, leaf, init_std, scaled, split)
    if leaf.startswith(("router.", "experts.", "shared_expert.")):
        return _moe_spec(c, name, leaf, init_std, scaled, split)
    if leaf.startswith(("qkv", "o_proj")):
        a = c.attention_view()
        q, kv = a.num_attention_heads * a.head_dim, a.n_kv_heads * a.head_dim
        if leaf == "qkv.weight":
            return InitSpec(
                name, (q + 2 * kv, h), init_std, split, (q, kv, kv), fan=(h, q + 2 * kv)
            )
        if leaf == "qkv.bias":
            return InitSpec(name, (q + 2 * kv,), 0.0, split, (q, kv, kv))
        if leaf == "o_proj.weight":
            return InitSpec(name, (h, q), scaled, split, fan=(q, h))
    inter = c.intermediate_size
    if leaf == "up.weight":
        return InitSpec(name, (inter, h), init_std, split, fan=(h, inter))
    if leaf == "down.weight":
        return InitSpec(name, (h, inter), scaled, split, fan=(inter, h))
    if leaf in ("up.bias", "down.bias"):
        return InitSpec(name, (inter if leaf == "up.bias" else h,), 0.0, split)
    raise KeyError(f"no initialisation rule for parameter {name!r}")


def _mamba_spec(c, name: str, leaf: str, std: float, scaled: float, split) -> InitSpec:
    d, h = c.mamba_dims, c.hidden_size
    proj, conv = mamba_sections(c)
    k = d.conv_kernel
    table = {
        "in_proj.weight": ((d.in_proj_size, h), std, proj, (h, d.in_proj_size)),
        "in_proj.bias": ((d.in_proj_size,), 0.0, proj, None),
        # PyTorch's conv default has variance 1/(3K): the same here, as a normal
        "conv1d.weight": ((d.conv_dim, 1, k), 1 / math.sqrt(3 * k), conv, None),
        "conv1d.bias": ((d.conv_dim,), 0.0, conv, None),
        "out_proj.weight": ((h, d.intermediate_size), scaled, None, (d.intermediate_size, h)),
        "out_proj.bias": ((h,), 0.0, None, None),
    }
    shape, s, sections, fan = table[leaf]
    return InitSpec(name, shape, s, split, sections, fan=fan)


def _moe_spec(c, name: str, leaf: str, std: float, scaled: float, split) -> InitSpec:
    """An `E` layer's parameters: every expert drawn whole (the same at any ep), output
    projections scaled as the other layers'."""
    e, h, i, shared = (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size,
                       c.moe_shared_expert_intermediate_size)  # fmt: skip
    table = {
        "router.weight": ((e, h), std, False, None),
        "experts.up_proj": ((e, h, i), std, True, None),
        "experts.down_proj": ((e, i, h), scaled, True, None),
        "shared_expert.up.weight": ((shared, h), std, False, (h, shared)),
        "shared_expert.up.bias": ((shared,), 0.0, False, None),
        "shared_expert.down.weight": ((h, shared), scaled, False, (shared, h)),
        "shared_expert.down.bias": ((h,), 0.0, False, None),
    }
    shape, s, experts, fan = table[leaf]
    return InitSpec(name, shape, s, split, fan=fan, experts=experts)


@torch.no_grad()
def fill_head_params(stage: torch.nn.Module, config: Mamba2HybridConfig, seed: int) -> None:
    """A_log, D and dt_bias as Hugging Face initialises them, the full tensors drawn from a
    generator seeded by (seed, name) and each rank keeping its heads: the same in any layout."""
    for name, param in stage.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in HEAD_PARAMS:
            continue
        gen = torch.Generator().manual_seed(param_seed(seed, name.rsplit(".", 1)[0]))
        full = mamba2_ssm_init(config.num_heads, gen, config.time_step_min,
                               config.time_step_max, config.time_step_floor)[leaf]  # fmt: skip
        part = param.shape[0]
        rank = stage.pc.tp_rank if part < full.shape[0] else 0
        param.copy_(full[rank * part : (rank + 1) * part].to(param.dtype))


# ---- blocks, sizes and FLOPs ----------------------------------------------------------------


def hybrid_block_names(config: Mamba2HybridConfig) -> list[str]:
    return ["embedding", *(f"decoder.{i}" for i in range(config.num_hidden_layers)),
            "final_norm", "lm_head", "loss"]  # fmt: skip


def _layer_matmul_params(c: Mamba2HybridConfig, layer: int, active: bool = True) -> int:
    """Matmul weights of a layer; of an `E` layer the router, the shared expert and the
    experts a token runs through (`active`) or every expert."""
    kind, h = c.layer_kind(layer), c.hidden_size
    if kind == "E":
        experts = c.num_experts_per_tok if active else c.n_routed_experts
        per_expert = 2 * h * c.moe_intermediate_size
        return (
            h * c.n_routed_experts
            + experts * per_expert
            + 2 * h * c.moe_shared_expert_intermediate_size
        )
    if kind == "M":
        d = c.mamba_dims
        return h * d.in_proj_size + d.intermediate_size * h
    if kind == "*":
        a = c.attention_view()
        return h * (2 * a.num_attention_heads + 2 * a.n_kv_heads) * a.head_dim
    return 2 * h * c.intermediate_size


def _mixer_flops(c: Mamba2HybridConfig, layer: int, s: int) -> float:
    """Forward FLOPs per token beyond the matmuls: the attention's scores (PaLM's 4 h s,
    causality not halved) or the SSD scan's (chunk-local scores, state in and out, conv)."""
    kind = c.layer_kind(layer)
    if kind == "*":
        a = c.attention_view()
        return 4.0 * s * a.num_attention_heads * a.head_dim
    if kind == "M":
        d = c.mamba_dims
        q = min(d.chunk_size, s)
        inner, gn = d.intermediate_size, d.n_groups * d.state_size
        # C B^T in a chunk + its product with x + states in/out of chunks + the conv
        return (
            2.0 * q * gn
            + 2.0 * q * inner
            + 4.0 * inner * d.state_size
            + 2.0 * d.conv_dim * d.conv_kernel
        )
    return 0.0


def hybrid_block_costs(config: Mamba2HybridConfig, seq_len: int) -> list[float]:
    """Forward FLOPs of each block for one sequence (pipeline placement by cost)."""
    c, s, h = config, seq_len, config.hidden_size
    layers = [
        float(s * (2 * _layer_matmul_params(c, i) + _mixer_flops(c, i, s) + 10 * h))
        for i in range(c.num_hidden_layers)
    ]
    return [float(s * h), *layers, float(4 * s * h), float(2 * s * c.vocab_size * h),
            float(5 * s * c.vocab_size)]  # fmt: skip


def hybrid_training_flops_per_token(config: Mamba2HybridConfig, seq_len: int) -> float:
    """6 N (the matmul weights, lm_head included) + 3 x each mixer's own forward FLOPs."""
    c = config
    n = sum(_layer_matmul_params(c, i) for i in range(c.num_hidden_layers))
    n += c.vocab_size * c.hidden_size
    return 6.0 * n + 3.0 * sum(_mixer_flops(c, i, seq_len) for i in range(c.num_hidden_layers))


def hybrid_num_parameters(config: Mamba2HybridConfig) -> int:
    """Trainable parameters of the unpadded model (a tied embedding counted once)."""
    c, h = config, config.hidden_size
    total = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h
    for i in range(c.num_hidden_layers):
        total += h + _layer_matmul_params(c, i, active=False)
        kind = c.layer_kind(i)
        if kind == "M":
            d = c.mamba_dims
            total += d.conv_dim * d.conv_kernel + 3 * d.num_heads + d.intermediate_size
            total += d.conv_dim * c.use_conv_bias + (d.in_proj_size + h) * c.use_bias
        elif kind == "*" and c.attention_bias:
            a = c.attention_view()
            total += (a.num_attention_heads + 2 * a.n_kv_heads) * a.head_dim
        elif kind == "-" and c.mlp_bias:
            total += c.intermediate_size + h
        elif kind == "E" and c.mlp_bias:
            total += c.moe_shared_expert_intermediate_size + h
    return total


def hybrid_activation_elements(
    config: Mamba2HybridConfig, tp: int, sequence_parallel: bool
) -> tuple[tuple[int, ...], int]:
    """(saved elements per token of each layer, of a layer's input) on a tp rank: the memory
    model. Counted from autograd's saved tensors of each layer kind with the scans in PyTorch
    (the CPU's path; the GPU's fused kernels save less): a Mamba-2 layer's norm, in_proj's
    output, the conv's input with its halo, output and activation, about nine copies of the
    inner width I (the scan's x, y, gate, norm), per chunk of c tokens the decay matrices
    (2 H c per token) and the chunk states (2 H P N / c per token)."""
    c, h = config, config.hidden_size
    hs = h // tp if sequence_parallel else h
    gathered = h if sequence_parallel and tp > 1 else 0  # a column-parallel linear's input
    d = c.mamba_dims
    chunk = d.chunk_size
    scan = (
        d.in_proj_size + 3 * d.conv_dim + 9 * d.intermediate_size + d.num_heads * d.state_size
        + 2 * d.n_groups * d.state_size + 3 * d.num_heads + 2 * d.num_heads * chunk
        + 2 * d.intermediate_size * d.state_size // chunk
    )  # fmt: skip
    per = {"M": 2 * hs + h + scan // tp}
    a = c.attention_view()
    qkv = (a.num_attention_heads + 2 * a.n_kv_heads) * a.head_dim // tp
    attn = a.num_attention_heads * (a.head_dim + 1) // tp  # output and fp32 log-sum-exp
    per["*"] = 2 * hs + gathered + qkv + attn
    per["-"] = 2 * hs + gathered + 2 * c.intermediate_size // tp  # relu2: up and its square
    # the routed copies of each token in and out with the experts' up and relu2 (2 x I), the
    # router's (about 6 per expert), the shared expert as an MLP
    k, i_e = c.num_experts_per_tok, c.moe_intermediate_size
    per["E"] = (2 * hs + gathered + k * (2 * h + 2 * i_e) + 6 * c.n_routed_experts
                + 2 * c.moe_shared_expert_intermediate_size // tp)  # fmt: skip
    return tuple(per[kind] for kind in c.pattern), hs
