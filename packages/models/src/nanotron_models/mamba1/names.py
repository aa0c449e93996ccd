"""The family's parameter names in Nanotron's examples/mamba tree: a layer's are ours under
`model.decoder.{i}.pp_block.` (`norm`, `mixer.*`, Hugging Face's mixer names), the embedding,
final norm and lm_head Llama's. Names only: Nanotron's in_proj interleaves the x and z rows."""

from __future__ import annotations

_MIXER = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj.weight",
          "dt_proj.weight", "dt_proj.bias", "A_log", "D", "out_proj.weight", "out_proj.bias")  # fmt: skip
MAMBA1_NANOTRON_LAYER_NAMES = {
    "norm.weight": "norm.weight",
    **{f"mixer.{n}": f"mixer.{n}" for n in _MIXER},
}
