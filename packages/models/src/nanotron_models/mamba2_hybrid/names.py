"""The family's parameter names in a Nanotron-style tree: Nanotron has no Mamba-2 family, so a
layer's names are ours under `model.decoder.{i}.pp_block.` (weight-decay patterns written for
either match), the embedding, final norm and lm_head Nanotron's."""

from __future__ import annotations

_MAMBA = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log",
          "D", "norm.weight", "out_proj.weight", "out_proj.bias")  # fmt: skip
_OTHER = ("qkv.weight", "qkv.bias", "o_proj.weight", "up.weight", "up.bias", "down.weight",
          "down.bias", "router.weight", "experts.up_proj", "experts.down_proj",
          "shared_expert.up.weight", "shared_expert.up.bias", "shared_expert.down.weight",
          "shared_expert.down.bias")  # fmt: skip
HYBRID_NANOTRON_LAYER_NAMES = {
    "norm.weight": "norm.weight",
    **{f"mixer.{n}": f"mixer.{n}" for n in _MAMBA + _OTHER},
}
