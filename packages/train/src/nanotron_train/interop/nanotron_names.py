"""Our parameter names <-> Nanotron's (its LlamaForTraining / Qwen2 module tree).

Used where a Nanotron user writes or has Nanotron names: the regexes of
`optimizer.weight_decay_exclude_named_params` and the files of a Nanotron checkpoint.
"""

from __future__ import annotations

import re

_DECODER = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "attn.qkv.weight": "attn.qkv_proj.weight",
    "attn.qkv.bias": "attn.qkv_proj.bias",
    "attn.o_proj.weight": "attn.o_proj.weight",
    "attn.o_proj.bias": "attn.o_proj.bias",
    "mlp.gate_up.weight": "mlp.gate_up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
    # A Qwen2 MoE layer (Nanotron's nn/moe.py): the experts stacked the same way, [E, H, 2I]
    "mlp.router.weight": "mlp.router.weight",
    "mlp.experts.gate_up_proj": "mlp.experts.merged_gate_up_proj",
    "mlp.experts.down_proj": "mlp.experts.merged_down_proj",
    "mlp.shared_expert.gate_up.weight": "mlp.shared_expert.gate_up_proj.weight",
    "mlp.shared_expert.down.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
_TOP = {
    "embedding.weight": "model.token_position_embeddings.pp_block.token_embedding.weight",
    "final_norm.weight": "model.final_layer_norm.pp_block.weight",
    "lm_head.weight": "model.lm_head.pp_block.weight",
}
_LAYER = re.compile(r"decoder\.(\d+)\.(.+)")


def to_nanotron(name: str) -> str | None:
    """Nanotron's name of our parameter `name` (any prefix before the global name, such as an
    interleaved chunk's, is ignored); None when Nanotron has no such parameter."""
    for ours, theirs in _TOP.items():
        if name == ours or name.endswith("." + ours):
            return theirs
    match = _LAYER.search(name)
    if match and match.group(2) in _DECODER:
        return f"model.decoder.{match.group(1)}.pp_block.{_DECODER[match.group(2)]}"
    return None


def from_nanotron(name: str) -> str | None:
    """Our global name of Nanotron's parameter `name`; None when we have no such parameter."""
    for ours, theirs in _TOP.items():
        if name == theirs:
            return ours
    match = re.fullmatch(r"model\.decoder\.(\d+)\.pp_block\.(.+)", name)
    if match:
        for ours, theirs in _DECODER.items():
            if theirs == match.group(2):
                return f"decoder.{match.group(1)}.{ours}"
    return None


def excluded_from_weight_decay(name: str, patterns: list[str] | None) -> bool:
    """Nanotron's rule: a parameter gets no weight decay when a pattern re.match-es its name.
    We try our name and Nanotron's, so patterns written for either work."""
    if not patterns:
        return False
    names = [name, to_nanotron(name) or name]
    return any(re.match(p, n) for p in patterns for n in names)
