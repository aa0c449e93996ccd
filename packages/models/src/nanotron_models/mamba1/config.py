"""The Mamba-1 family's config: Nanotron's `examples/mamba` `MambaModelConfig`, its keys and
meanings (a pure stack of Mamba-1 layers, each `x + mixer(RMSNorm(x))`, then a final RMSNorm and
the lm_head, tied to the embedding as the example ties it; Hugging Face's MambaForCausalLM).

`ssm_cfg` holds the mixer's keys (mamba_ssm's `Mamba` arguments, the example passes them on):
d_state, d_conv, expand, dt_rank ("auto": ceil(d_model / 16)), dt_min / dt_max / dt_init_floor
(dt_proj's bias: the inverse softplus of a log-uniform dt in [dt_min, dt_max], floored),
dt_init ("random" | "constant") and dt_scale (dt_proj's weight, +-dt_scale / sqrt(dt_rank)),
conv_bias, bias (in_proj's and out_proj's), use_fast_path (the CUDA kernels when installed:
the same maths). `residual_in_fp32`: the residual stream is kept in fp32 under a lower
model.dtype; `fused_add_norm`: mamba_ssm's fused add + norm kernel, the same maths, so it is a
kernel choice here; `pad_vocab_size_multiple` pads nothing, as in Nanotron's example (only
mamba_ssm's own model reads it; model.make_vocab_size_divisible_by pads the vocabulary).
`is_mamba_config: true` names the family in a YAML.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import DecoderConfig, ModelCheck
from ..mixers import Mamba1Dims

_MC = "model_config"
# mamba_ssm's Mamba(...) defaults, which Nanotron's example takes for a key ssm_cfg leaves out
SSM_DEFAULTS: dict[str, Any] = {
    "d_state": 16, "d_conv": 4, "expand": 2, "dt_rank": "auto", "dt_min": 0.001, "dt_max": 0.1,
    "dt_init": "random", "dt_scale": 1.0, "dt_init_floor": 1e-4, "conv_bias": True,
    "bias": False, "use_fast_path": True,
}  # fmt: skip


@dataclass
class MambaConfig(DecoderConfig):
    """Nanotron's MambaModelConfig fields and defaults, plus what every family has."""

    is_mamba_config: bool = True
    d_model: int = 2560
    num_hidden_layers: int = 64
    vocab_size: int = 50277
    ssm_cfg: dict[str, Any] | None = None
    rms_norm: bool = True
    fused_add_norm: bool = True
    residual_in_fp32: bool = True
    pad_vocab_size_multiple: int = 8
    dtype: str | None = None  # Nanotron's layers' dtype: null or model.dtype (one dtype here)
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = None  # Nanotron: the embedding's padding_idx (only null here)
    # ours, as every family (HF MambaConfig's defaults)
    tie_word_embeddings: bool = True  # Nanotron's example always ties them
    bos_token_id: int | None = 0
    eos_token_id: int | None = 0
    initializer_range: float = 0.1  # HF's; a YAML's init_method.initializer_range wins
    max_position_embeddings: int = 4096  # generation's limit (Mamba itself has none)
    _use_doc_masking: bool = False  # packed documents reset the conv and the SSM state
    z_loss_enabled: bool = False
    z_loss_coefficient: float = 0.0001
    _fused_rms_norm: bool = True
    attn_backend: str = "auto"  # no attention: what HybridStage asks every config
    _attn_implementation: str | None = None

    def checks(self) -> tuple[ModelCheck, ...]:
        return MAMBA1_CHECKS

    def ssm(self, key: str) -> Any:
        """An ssm_cfg key, or its default."""
        return (self.ssm_cfg or {}).get(key, SSM_DEFAULTS[key])

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def layer_norm_epsilon(self) -> float:
        return self.rms_norm_eps

    @property
    def intermediate_size(self) -> int:
        return int(self.ssm("expand") * self.d_model)

    @property
    def dt_rank(self) -> int:
        rank = self.ssm("dt_rank")
        return math.ceil(self.d_model / 16) if rank == "auto" else rank

    def layer_kind(self, layer: int) -> str:
        return "M"

    # no attention: no key/value heads for the memory model's context-parallel gather
    n_kv_heads = 0
    head_dim = 0

    @property
    def mamba_dims(self) -> Mamba1Dims:
        return Mamba1Dims(
            hidden_size=self.d_model, intermediate_size=self.intermediate_size,
            state_size=self.ssm("d_state"), conv_kernel=self.ssm("d_conv"),
            time_step_rank=self.dt_rank, use_conv_bias=bool(self.ssm("conv_bias")),
            use_bias=bool(self.ssm("bias")),
        )  # fmt: skip


def _row(holds, message) -> ModelCheck:
    return ModelCheck(lambda c, tp: bool(holds(c, tp)), message)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ssm_ok(key: str, value: Any) -> bool:
    if key in ("d_state", "d_conv", "expand"):
        return _int(value)
    if key == "dt_rank":
        return value == "auto" or _int(value)
    if key == "dt_init":
        return value in ("random", "constant")
    if key in ("conv_bias", "bias", "use_fast_path"):
        return isinstance(value, bool)
    return _num(value) and value > 0  # dt_min, dt_max, dt_scale, dt_init_floor


def _bad_ssm(c: MambaConfig) -> str | None:
    """The first ssm_cfg key that is unknown or of a wrong value, as a message."""
    if c.ssm_cfg is not None and not isinstance(c.ssm_cfg, dict):
        return f"{_MC}.ssm_cfg must be a mapping or null, got {c.ssm_cfg!r}"
    for key, value in (c.ssm_cfg or {}).items():
        if key not in SSM_DEFAULTS:
            return f"{_MC}.ssm_cfg.{key}: unknown key (known: {', '.join(SSM_DEFAULTS)})"
        if not _ssm_ok(key, value):
            return f"{_MC}.ssm_cfg.{key}: invalid value {value!r}"
    return None


def _ints(*names: str) -> list[ModelCheck]:
    return [
        _row(lambda c, tp, n=n: _int(getattr(c, n)),
             lambda c, tp, n=n: f"{_MC}.{n} must be a positive integer, got {getattr(c, n)!r}")
        for n in names
    ]  # fmt: skip


def _token_ok(c: MambaConfig, name: str) -> bool:
    value = getattr(c, name)
    return value is None or (isinstance(value, int) and 0 <= value < c.vocab_size)


# Rows run in order (a row may assume those above passed); each names its key.
MAMBA1_CHECKS: tuple[ModelCheck, ...] = (
    *_ints("vocab_size", "d_model", "num_hidden_layers", "pad_vocab_size_multiple",
           "max_position_embeddings"),
    _row(lambda c, tp: _int(tp), lambda c, tp: f"tensor parallel size must be positive, got {tp!r}"),
    _row(lambda c, tp: _bad_ssm(c) is None, lambda c, tp: _bad_ssm(c)),
    _row(lambda c, tp: c.ssm("dt_min") <= c.ssm("dt_max"),
         lambda c, tp: f"{_MC}.ssm_cfg.dt_min ({c.ssm('dt_min')}) must be <= dt_max "
                       f"({c.ssm('dt_max')})"),
    _row(lambda c, tp: c.intermediate_size % tp == 0,
         lambda c, tp: f"{_MC}.ssm_cfg.expand * d_model ({c.intermediate_size}) must be "
                       f"divisible by tp ({tp})"),
    _row(lambda c, tp: c.rms_norm,
         lambda c, tp: f"{_MC}.rms_norm: false (LayerNorm) is not supported; Hugging Face's "
                       "MambaForCausalLM has RMSNorm only"),
    _row(lambda c, tp: c.pad_token_id is None,
         lambda c, tp: f"{_MC}.pad_token_id: Nanotron makes it the embedding's padding_idx (a "
                       "row that never trains), which is not supported: set it to null"),
    _row(lambda c, tp: c.dtype in (None, "float32", "bfloat16", "float16"),
         lambda c, tp: f"{_MC}.dtype {c.dtype!r} is not float32, bfloat16 or float16"),
    _row(lambda c, tp: c.initializer_range > 0,
         lambda c, tp: f"{_MC}.initializer_range must be positive, got {c.initializer_range}"),
    *(
        _row(lambda c, tp, n=name: _token_ok(c, n),
             lambda c, tp, n=name: f"{_MC}.{n} must be None or in [0, vocab_size), got "
                                   f"{getattr(c, n)!r}")
        for name in ("bos_token_id", "eos_token_id")
    ),
)  # fmt: skip
