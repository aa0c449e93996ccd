"""Hugging Face interop of the Mamba-1 family, both ways: `MambaForCausalLM`.

Config: Nanotron's example's converter's correspondence (d_model = hidden_size, rms_norm_eps =
layer_norm_epsilon, ssm_cfg d_state / d_conv / expand / bias / conv_bias / dt_rank / dt_scale /
dt_min / dt_max / dt_init / dt_init_floor = state_size / conv_kernel / expand / use_bias /
use_conv_bias / time_step_rank / time_step_scale / time_step_min / time_step_max /
time_step_init_scheme / time_step_floor). HF's pad_token_id is only an id there (no
padding_idx): not read. Weights: HF's names are ours (`backbone.layers.{i}.{norm,mixer}.*` <->
`decoder.{i}.*`), in_proj's rows in HF's order [x | z] (Nanotron's checkpoints interleave them).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import ModelConfigError
from .config import MambaConfig

_SSM = {"d_state": "state_size", "d_conv": "conv_kernel", "expand": "expand", "bias": "use_bias",
        "conv_bias": "use_conv_bias", "dt_rank": "time_step_rank", "dt_scale": "time_step_scale",
        "dt_min": "time_step_min", "dt_max": "time_step_max",
        "dt_init": "time_step_init_scheme", "dt_init_floor": "time_step_floor"}  # fmt: skip
_TOP = {"d_model": "hidden_size", "num_hidden_layers": "num_hidden_layers",
        "vocab_size": "vocab_size", "rms_norm_eps": "layer_norm_epsilon",
        "residual_in_fp32": "residual_in_fp32", "tie_word_embeddings": "tie_word_embeddings",
        "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
        "initializer_range": "initializer_range"}  # fmt: skip
PREFIX = "backbone"


def _get(hf: Any, key: str, default: Any = None) -> Any:
    return hf.get(key, default) if isinstance(hf, dict) else getattr(hf, key, default)


def config_from_hf(hf: Any) -> MambaConfig:
    """Our config from a transformers MambaConfig (or its config.json dict)."""
    if _get(hf, "hidden_act", "silu") != "silu":
        raise ModelConfigError(f"Mamba: hidden_act {_get(hf, 'hidden_act')!r} (only silu)")
    hidden, expand = _get(hf, "hidden_size"), _get(hf, "expand", 2)
    inner = _get(hf, "intermediate_size", expand * hidden)
    if inner != int(expand * hidden):
        raise ModelConfigError(f"Mamba: intermediate_size {inner} is not expand * hidden_size")
    kw = {ours: _get(hf, theirs) for ours, theirs in _TOP.items() if _get(hf, theirs) is not None}
    ssm = {ours: _get(hf, theirs) for ours, theirs in _SSM.items() if _get(hf, theirs) is not None}
    if ssm.get("dt_rank") == math.ceil(hidden / 16):
        ssm["dt_rank"] = "auto"
    return MambaConfig(**kw, ssm_cfg=ssm)


def config_to_hf(c: MambaConfig) -> Any:
    """A transformers MambaConfig describing the same model."""
    import transformers

    kw = {theirs: getattr(c, ours) for ours, theirs in _TOP.items()}
    kw.update({theirs: c.ssm(ours) for ours, theirs in _SSM.items()})
    kw["time_step_rank"] = c.dt_rank
    return transformers.MambaConfig(**kw, pad_token_id=None, hidden_act="silu")


def architecture(c: MambaConfig) -> str:
    return "MambaForCausalLM"


def _layer_leaves(c: MambaConfig) -> list[str]:
    leaves = ["norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.x_proj.weight",
              "mixer.dt_proj.weight", "mixer.dt_proj.bias", "mixer.A_log", "mixer.D",
              "mixer.out_proj.weight"]  # fmt: skip
    leaves += ["mixer.conv1d.bias"] * bool(c.ssm("conv_bias"))
    return leaves + ["mixer.in_proj.bias", "mixer.out_proj.bias"] * bool(c.ssm("bias"))


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], c: MambaConfig) -> dict:
    """HF names -> our global names, full tensors."""

    def take(key: str) -> torch.Tensor:
        if key not in hf_sd:
            raise ModelConfigError(f"Hugging Face state dict has no {key!r}")
        return hf_sd[key]

    out = {"embedding.weight": take(f"{PREFIX}.embeddings.weight"),
           "final_norm.weight": take(f"{PREFIX}.norm_f.weight")}  # fmt: skip
    for i in range(c.num_hidden_layers):
        for leaf in _layer_leaves(c):
            out[f"decoder.{i}.{leaf}"] = take(f"{PREFIX}.layers.{i}.{leaf}")
    tied = c.tie_word_embeddings or "lm_head.weight" not in hf_sd
    out["lm_head.weight"] = out["embedding.weight"] if tied else hf_sd["lm_head.weight"]
    return out


def state_dict_to_hf(full_sd: dict[str, torch.Tensor], c: MambaConfig) -> dict:
    """Our full state dict (padded or not) -> HF names."""
    v = c.vocab_size
    out = {f"{PREFIX}.embeddings.weight": full_sd["embedding.weight"][:v],
           f"{PREFIX}.norm_f.weight": full_sd["final_norm.weight"]}  # fmt: skip
    for i in range(c.num_hidden_layers):
        for leaf in _layer_leaves(c):
            out[f"{PREFIX}.layers.{i}.{leaf}"] = full_sd[f"decoder.{i}.{leaf}"]
    out["lm_head.weight"] = full_sd.get("lm_head.weight", full_sd["embedding.weight"])[:v]
    return out
