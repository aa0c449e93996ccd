"""Topology-independent initialisation: each parameter's FULL tensor comes from a generator seeded
by (seed, global parameter name), then each rank keeps its own shard.

So the same seed gives bitwise the same full weights whatever tp / pp is. Only one full tensor
exists at a time (generated on the CPU in fp32, then sharded and cast).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .config import LlamaConfig
from .tp_plan import Split, TPPlan

# Llama's (and Qwen2's) tensor-parallel plan, Megatron's: attention's fused q/k/v and the
# MLPs' fused gate/up (a MoE layer's shared expert too) cut by output, their output
# projections by input; the embedding and the lm_head by vocab rows. blocks.py builds its
# layers by it; `llama_init_spec` cuts each parameter by it.
LLAMA_TP_PLAN = TPPlan(
    {
        "embedding": Split.VOCAB,
        "lm_head": Split.COLUMN,
        "attn.qkv": Split.COLUMN,
        "attn.o_proj": Split.ROW,
        "gate_up": Split.COLUMN,
        "down": Split.ROW,
    }
)


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed derived from the run seed and the parameter's global name."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class InitSpec:
    """How to build one parameter's full tensor and cut this rank's shard from it."""

    key: str  # the name the generator is seeded with (the tied source's name for a tied lm_head)
    full_shape: tuple[int, ...]  # unpadded
    std: float | None  # None -> ones (norm weights), 0.0 -> zeros (biases)
    shard_dim: int | None  # None -> replicated over tp (the family's TPPlan says)
    sections: tuple[int, ...] | None = None
    pad_rows_to: int | None = None  # vocab padding: zero rows appended up to this size
    experts: bool = False  # dim 0 indexes the global experts: a rank keeps its local ones
    # For µP (parametrization.py): (fan_in, fan_out) of a full linear weight, and whether the
    # parameter is an embedding (the vocabulary's rows, tied lm_head included).
    fan: tuple[int, int] | None = None
    embedding: bool = False
    readout: bool = False  # the untied lm_head (its vocabulary side does not grow with width)
    # A MoE router or gate: hidden -> a size that does not grow with width (the experts, one
    # gate) inside a block: µP's output-layer rule as init and learning rate (parametrization.py)
    router: bool = False
    # Per section, (n, parts): rows that are n repeats of sub-blocks, each part one logical
    # matrix for Muon (ParamMeta.interleaved), e.g. a head-major fused projection.
    interleaved: tuple[tuple[int, tuple[int, ...]], ...] | None = None


def full_tensor(spec: InitSpec, seed: int) -> torch.Tensor:
    """The full (vocab-padded) fp32 CPU tensor for `spec`."""
    if spec.std is None:
        full = torch.ones(spec.full_shape)
    elif spec.std == 0.0:
        full = torch.zeros(spec.full_shape)
    else:
        gen = torch.Generator().manual_seed(param_seed(seed, spec.key))
        full = torch.empty(spec.full_shape).normal_(0.0, spec.std, generator=gen)
    if spec.pad_rows_to is not None and spec.pad_rows_to > full.shape[0]:
        pad = torch.zeros(spec.pad_rows_to - full.shape[0], *full.shape[1:])
        full = torch.cat((full, pad), dim=0)
    return full


SCALING_METHODS = ("NUM_LAYERS", "NONE")


def llama_init_spec(
    config: LlamaConfig, name: str, init_std: float, tp: int, scaling_method: str = "NUM_LAYERS"
) -> InitSpec:
    """The InitSpec of the parameter with global name `name` (see blocks.py for the names).

    `scaling_method` (Nanotron's init_method.scaling_method) scales the std of the projections
    that write into the residual stream: NUM_LAYERS divides it by sqrt(2 * layers), NONE not.
    """
    c = config
    h, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * d, c.n_kv_heads * d
    if scaling_method not in SCALING_METHODS:
        raise ValueError(f"scaling_method must be one of {SCALING_METHODS}, got {scaling_method!r}")
    scaled = (
        init_std / math.sqrt(2 * c.num_hidden_layers)
        if scaling_method == "NUM_LAYERS"
        else init_std
    )
    vpad = c.padded_vocab_size(tp)
    split = LLAMA_TP_PLAN.shard_dim(name)
    if name == "embedding.weight" or (name == "lm_head.weight" and c.tie_word_embeddings):
        key = "embedding.weight"
        return InitSpec(key, (c.vocab_size, h), init_std, split, pad_rows_to=vpad, embedding=True)
    if name == "lm_head.weight":
        fan = (h, c.vocab_size)
        return InitSpec(
            name, (c.vocab_size, h), init_std, split, pad_rows_to=vpad, fan=fan, readout=True
        )
    if name == "final_norm.weight" or name.endswith("_norm.weight"):
        return InitSpec(name, (h,), None, split)
    if name.endswith("attn.qkv.weight"):
        return InitSpec(name, (q + 2 * kv, h), init_std, split, (q, kv, kv), fan=(h, q + 2 * kv))
    if name.endswith("attn.qkv.bias"):
        return InitSpec(name, (q + 2 * kv,), 0.0, split, (q, kv, kv))
    if name.endswith("attn.o_proj.bias"):
        return InitSpec(name, (h,), 0.0, split)
    if name.endswith("attn.o_proj.weight"):
        return InitSpec(name, (h, q), scaled, split, fan=(q, h))
    if name.endswith("mlp.gate_up.weight"):
        return InitSpec(name, (2 * inter, h), init_std, split, (inter, inter), fan=(h, 2 * inter))
    if name.endswith("mlp.down.weight"):
        return InitSpec(name, (h, inter), scaled, split, fan=(inter, h))
    if ".mlp." in name and getattr(c, "moe_config", None) is not None:
        return moe_init_spec(c, name, init_std, scaled)
    raise KeyError(f"no initialisation rule for parameter {name!r}")


def moe_init_spec(c, name: str, init_std: float, scaled: float) -> InitSpec:
    """A MoE block's parameters (moe/): the router, the shared expert's gate and the routed
    experts replicated over tp, the experts generated whole over every expert (so any expert
    parallel size starts from the same weights); the shared expert is a tp-sharded MLP, its
    output projection scaled as the dense one's. For µP: each expert's and the shared expert's
    matrices have their (per expert) fans, as the dense MLP's; the router and the shared
    expert's gate are `router`s, whose fan-out (experts, 1) does not grow with width."""
    m, h = c.moe_config, c.hidden_size
    moe_inter, shared = m.moe_intermediate_size, m.shared_expert_intermediate_size
    split = LLAMA_TP_PLAN.shard_dim(name)
    if name.endswith("mlp.router.weight"):
        fan = (h, m.num_experts)
        return InitSpec(name, (m.num_experts, h), init_std, split, fan=fan, router=True)
    if name.endswith("mlp.experts.gate_up_proj"):
        return InitSpec(name, (m.num_experts, h, 2 * moe_inter), init_std, split, experts=True,
                        fan=(h, 2 * moe_inter))  # fmt: skip
    if name.endswith("mlp.experts.down_proj"):
        return InitSpec(name, (m.num_experts, moe_inter, h), scaled, split, experts=True,
                        fan=(moe_inter, h))  # fmt: skip
    if name.endswith("mlp.shared_expert.gate_up.weight"):
        fan = (h, 2 * shared)
        return InitSpec(name, (2 * shared, h), init_std, split, (shared, shared), fan=fan)
    if name.endswith("mlp.shared_expert.down.weight"):
        return InitSpec(name, (h, shared), scaled, split, fan=(shared, h))
    if name.endswith("mlp.shared_expert_gate.weight"):
        return InitSpec(name, (1, h), init_std, split, fan=(h, 1), router=True)
    raise KeyError(f"no initialisation rule for parameter {name!r}")
