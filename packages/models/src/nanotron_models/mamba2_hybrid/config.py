"""The Mamba-2 / hybrid family's config: Hugging Face `Mamba2Config`'s keys for the Mamba-2
layers and `NemotronHConfig`'s `hybrid_override_pattern` for hybrids.

Each letter of the pattern is one residual layer (a norm and one mixer), Megatron's and
Nemotron-H's notation: `M` Mamba-2 (mixers/mamba2.py), `*` attention (our GQA attention,
without rotary embeddings as in Nemotron-H; document masks), `-` MLP (Nemotron-H's
non-gated up/down with relu2). `E` (Nemotron-H's mixture of experts) is refused in one line:
not built yet. No pattern: every layer is `M` (Hugging Face's `Mamba2ForCausalLM`).

`head_dim` is the Mamba-2 head size (HF's name); the attention's is `attention_head_dim`.
`is_mamba2_config: true` names the family in a YAML.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import DecoderConfig, ModelCheck
from ..mixers import Mamba2Dims

LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "experts"}
BUILT = "M*-"  # the letters built today
_MC = "model_config"


@dataclass
class Mamba2HybridConfig(DecoderConfig):
    """HF `Mamba2Config`'s fields and defaults, plus the hybrid's attention and MLP keys."""

    is_mamba2_config: bool = True
    vocab_size: int = 32768
    hidden_size: int = 4096
    num_hidden_layers: int = 64
    hybrid_override_pattern: str | None = None  # None: "M" * num_hidden_layers
    # the Mamba-2 layers (HF Mamba2Config)
    num_heads: int = 128
    head_dim: int = 64
    n_groups: int = 8
    state_size: int = 128
    expand: int = 2
    conv_kernel: int = 4
    chunk_size: int = 256
    use_conv_bias: bool = True
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    # dt clamped to [low, high]; high null: no bound (HF's inf; a YAML float must be finite)
    time_step_limit: tuple[float | None, ...] = (0.0, None)
    rms_norm: bool = True  # the gated group RMSNorm (False is refused)
    residual_in_fp32: bool = False  # the residual stream is in model.dtype (True is refused)
    # the `*` layers
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    attention_head_dim: int | None = None  # None: hidden_size // num_attention_heads
    attention_bias: bool = False
    _use_doc_masking: bool = False  # packed documents: attention masks and Mamba-2 resets
    attn_backend: str = "auto"
    _attn_implementation: str | None = None
    # the `-` layers (Nemotron-H's MLP)
    intermediate_size: int = 4 * 4096
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # the rest, as every family
    initializer_range: float = 0.1
    max_position_embeddings: int = 4096  # generation's limit (Mamba-2 itself has none)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 0
    pad_token_id: int | None = 0
    z_loss_enabled: bool = False
    z_loss_coefficient: float = 0.0001
    _fused_rms_norm: bool = True

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.time_step_limit = tuple(
            None if x is None or x == math.inf else float(x) for x in self.time_step_limit
        )

    def checks(self) -> tuple[ModelCheck, ...]:
        return MAMBA2_CHECKS

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["time_step_limit"] = list(self.time_step_limit)
        return d

    # ---- the layers ----
    @property
    def pattern(self) -> str:
        return self.hybrid_override_pattern or "M" * self.num_hidden_layers

    def layer_kind(self, layer: int) -> str:
        """'M', '*', '-' or 'E' for layer `layer` (0-based)."""
        return self.pattern[layer]

    @property
    def mamba_dims(self) -> Mamba2Dims:
        return Mamba2Dims(
            hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
            n_groups=self.n_groups, state_size=self.state_size, conv_kernel=self.conv_kernel,
            chunk_size=self.chunk_size, use_conv_bias=self.use_conv_bias,
            use_bias=self.use_bias, norm_eps=self.layer_norm_epsilon,
            time_step_limit=self.dt_limits,
        )  # fmt: skip

    @property
    def dt_limits(self) -> tuple[float, float]:
        """time_step_limit with its open upper bound as inf (the mixer's clamp)."""
        low, high = self.time_step_limit
        return (low, math.inf if high is None else high)

    # ---- what our attention block reads (blocks.Attention) ----
    @property
    def rms_norm_eps(self) -> float:
        return self.layer_norm_epsilon

    @property
    def attn_head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    def attention_view(self) -> AttentionView:
        return AttentionView(
            self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
            self.attn_head_dim, self.attention_bias, self.document_masking,
        )  # fmt: skip


@dataclass(frozen=True)
class AttentionView:
    """The attention keys as our attention block reads them (its config's names), for the
    `*` layers: Nemotron-H's attention has no rotary embedding, no window, no o_proj bias."""

    hidden_size: int
    num_attention_heads: int
    n_kv_heads: int
    head_dim: int
    attention_bias: bool
    document_masking: bool
    o_proj_bias: bool = False

    def uses_rope(self, layer: int) -> bool:
        return False

    def sliding_window(self, layer: int) -> int | None:
        return None


def _row(holds, message) -> ModelCheck:
    return ModelCheck(lambda c, tp: bool(holds(c, tp)), message)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _ints(*names: str) -> list[ModelCheck]:
    return [
        _row(lambda c, tp, n=n: _int(getattr(c, n)),
             lambda c, tp, n=n: f"{_MC}.{n} must be a positive integer, got {getattr(c, n)!r}")
        for n in names
    ]  # fmt: skip


def _token_ok(c: Mamba2HybridConfig, name: str) -> bool:
    value = getattr(c, name)
    return value is None or (isinstance(value, int) and 0 <= value < c.vocab_size)


# Rows run in order (a row may assume those above passed); each names its key.
MAMBA2_CHECKS: tuple[ModelCheck, ...] = (
    *_ints("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim",
           "n_groups", "state_size", "conv_kernel", "chunk_size", "max_position_embeddings"),
    _row(lambda c, tp: _int(tp), lambda c, tp: f"tensor parallel size must be positive, got {tp!r}"),
    _row(lambda c, tp: set(c.pattern) <= set(LETTERS),
         lambda c, tp: f"{_MC}.hybrid_override_pattern {c.pattern!r}: letters are M, *, - and E"),
    _row(lambda c, tp: len(c.pattern) == c.num_hidden_layers,
         lambda c, tp: f"{_MC}.hybrid_override_pattern has {len(c.pattern)} letters but "
                       f"num_hidden_layers is {c.num_hidden_layers}"),
    _row(lambda c, tp: set(c.pattern) <= set(BUILT),
         lambda c, tp: f"{_MC}.hybrid_override_pattern: E (Nemotron-H's mixture of experts) is "
                       "not supported yet; use M, * and -"),
    _row(lambda c, tp: c.num_heads % c.n_groups == 0,
         lambda c, tp: f"{_MC}.num_heads ({c.num_heads}) must be a multiple of n_groups "
                       f"({c.n_groups})"),
    _row(lambda c, tp: c.num_heads % tp == 0,
         lambda c, tp: f"{_MC}.num_heads ({c.num_heads}) must be divisible by tp ({tp})"),
    _row(lambda c, tp: c.n_groups % tp == 0,
         lambda c, tp: f"{_MC}.n_groups ({c.n_groups}) must be divisible by tp ({tp})"),
    _row(lambda c, tp: c.num_heads * c.head_dim == c.expand * c.hidden_size,
         lambda c, tp: f"{_MC}.num_heads * head_dim ({c.num_heads * c.head_dim}) must equal "
                       f"expand * hidden_size ({c.expand * c.hidden_size})"),
    _row(lambda c, tp: c.rms_norm,
         lambda c, tp: f"{_MC}.rms_norm: false (no gated norm) is not supported"),
    _row(lambda c, tp: not c.residual_in_fp32,
         lambda c, tp: f"{_MC}.residual_in_fp32: true is not supported (the residual stream "
                       "is in model.dtype; the same in float32)"),
    _row(lambda c, tp: len(c.time_step_limit) == 2 and c.dt_limits[0] <= c.dt_limits[1],
         lambda c, tp: f"{_MC}.time_step_limit must be [low, high], got {c.time_step_limit!r}"),
    *_ints("num_attention_heads", "num_key_value_heads"),
    _row(lambda c, tp: "*" not in c.pattern or c.num_attention_heads % c.num_key_value_heads == 0,
         lambda c, tp: f"{_MC}.num_attention_heads ({c.num_attention_heads}) must be divisible "
                       f"by num_key_value_heads ({c.num_key_value_heads})"),
    _row(lambda c, tp: "*" not in c.pattern or c.num_key_value_heads % tp == 0,
         lambda c, tp: f"{_MC}.num_key_value_heads ({c.num_key_value_heads}) must be divisible "
                       f"by tp ({tp})"),
    _row(lambda c, tp: "-" not in c.pattern or (_int(c.intermediate_size)
                                                and c.intermediate_size % tp == 0),
         lambda c, tp: f"{_MC}.intermediate_size ({c.intermediate_size}) must be a positive "
                       f"multiple of tp ({tp})"),
    _row(lambda c, tp: c.mlp_hidden_act == "relu2",
         lambda c, tp: f"{_MC}.mlp_hidden_act must be 'relu2' (Nemotron-H's MLP), got "
                       f"{c.mlp_hidden_act!r}"),
    _row(lambda c, tp: c.attn_backend in ("auto", "sdpa", "flash_attn", "flex"),
         lambda c, tp: f"{_MC}.attn_backend {c.attn_backend!r} is not auto, sdpa, flash_attn or flex"),
    _row(lambda c, tp: c.initializer_range > 0,
         lambda c, tp: f"{_MC}.initializer_range must be positive, got {c.initializer_range}"),
    *(
        _row(lambda c, tp, n=name: _token_ok(c, n),
             lambda c, tp, n=name: f"{_MC}.{n} must be None or in [0, vocab_size), got "
                                   f"{getattr(c, n)!r}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
    ),
)  # fmt: skip
