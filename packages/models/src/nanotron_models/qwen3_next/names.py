"""The family's parameter names in a Nanotron-style tree: Nanotron has no Qwen3-Next family, so
a layer's names are ours under `model.decoder.{i}.pp_block.` (weight-decay patterns written for
either match), the embedding, final norm and lm_head Nanotron's."""

from __future__ import annotations

_MIXER = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log",
          "norm.weight", "out_proj.weight", "qkv.weight", "qkv.bias", "o_proj.weight",
          "o_proj.bias", "q_norm.weight", "k_norm.weight")  # fmt: skip
_MLP = ("gate_up.weight", "down.weight", "router.weight", "experts.gate_up_proj",
        "experts.down_proj", "shared_expert.gate_up.weight", "shared_expert.down.weight",
        "shared_expert_gate.weight")  # fmt: skip
QWEN3_NEXT_NANOTRON_LAYER_NAMES = {
    "input_norm.weight": "input_norm.weight",
    "post_attn_norm.weight": "post_attn_norm.weight",
    **{f"mixer.{n}": f"mixer.{n}" for n in _MIXER},
    **{f"mlp.{n}": f"mlp.{n}" for n in _MLP},
}
