"""The family's parameter names in a Nanotron-style tree: Nanotron has no Qwen3-Next family.
Names shared with Llama (the layer norms, the dense MLP, the MoE block's) keep Llama's Nanotron
names, as the rows' tables merge (a name means one parameter whatever the family); the mixers'
are ours under `model.decoder.{i}.pp_block.` (weight-decay patterns written for either match);
the embedding, final norm and lm_head are Nanotron's."""

from __future__ import annotations

from ..nanotron_names import LLAMA_NANOTRON_LAYER_NAMES

_MIXER = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log",
          "norm.weight", "out_proj.weight", "qkv.weight", "qkv.bias", "o_proj.weight",
          "o_proj.bias", "q_norm.weight", "k_norm.weight")  # fmt: skip
QWEN3_NEXT_NANOTRON_LAYER_NAMES = {
    **{k: v for k, v in LLAMA_NANOTRON_LAYER_NAMES.items() if not k.startswith("attn.")},
    **{f"mixer.{n}": f"mixer.{n}" for n in _MIXER},
}
