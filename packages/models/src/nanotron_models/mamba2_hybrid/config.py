"""The Mamba-2 / hybrid family's config: Hugging Face `Mamba2Config`'s keys for the Mamba-2
layers and `NemotronHConfig`'s `hybrid_override_pattern` for hybrids.

Each letter of the pattern is one residual layer (a norm and one mixer), Megatron's and
Nemotron-H's notation: `M` Mamba-2 (mixers/mamba2.py), `*` attention (our GQA attention,
without rotary embeddings as in Nemotron-H; document masks), `-` MLP (Nemotron-H's
non-gated up/down with relu2), `E` Nemotron-H's mixture of experts (our moe/ block: a sigmoid
router with its score-correction bias and group limit, relu2 experts, an ungated relu2 shared
expert; NemotronHConfig's keys). No pattern: every layer is `M` (`Mamba2ForCausalLM`).

`head_dim` is the Mamba-2 head size (HF's name); the attention's is `attention_head_dim`.
`is_mamba2_config: true` names the family in a YAML.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import DecoderConfig, ModelCheck
from ..mixers import Mamba2Dims
from ..moe.config import MoEConfig, MoEVariant, moe_config_error

LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "experts"}
MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "moe_shared_expert_intermediate_size", "n_group", "topk_group", "norm_topk_prob",
            "routed_scaling_factor", "moe_latent_size", "router_bias_update_rate",
            "router_aux_loss_coef", "router_z_loss_coef", "token_dispatcher_type")  # fmt: skip
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
    # the `E` layers (NemotronHConfig's keys and defaults; the shared expert's linears take
    # mlp_bias as HF's)
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    moe_latent_size: int | None = None  # a latent projection: not built (non-null is refused)
    # ... and ours (moe/config.py's meanings): the score-correction bias's update per step
    # (DeepSeek-V3's auxiliary-loss-free balancing, Megatron's moe_router_bias_update_rate),
    # the balance losses (off: Nemotron-H has none), the dispatcher under expert parallel
    router_bias_update_rate: float = 0.001
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    token_dispatcher_type: str = "alltoall"
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
        """The fields; the `E` keys only with an `E` layer (a checkpoint or an HF model
        without experts matches whatever they say)."""
        d = super().to_dict()
        d["time_step_limit"] = list(self.time_step_limit)
        if "E" not in self.pattern:
            for key in MOE_KEYS:
                d.pop(key)
        return d

    # ---- the layers ----
    @property
    def pattern(self) -> str:
        return self.hybrid_override_pattern or "M" * self.num_hidden_layers

    def layer_kind(self, layer: int) -> str:
        """'M', '*', '-' or 'E' for layer `layer` (0-based)."""
        return self.pattern[layer]

    @property
    def moe_config(self) -> MoEConfig | None:
        """The `E` layers as our MoE block and the trainer read them (None: no `E`)."""
        layers = [i for i, k in enumerate(self.pattern) if k == "E"]
        if not layers:
            return None
        return MoEConfig(
            num_experts=self.n_routed_experts, top_k=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
            router_aux_loss_coef=self.router_aux_loss_coef, layers=layers,
            enable_shared_expert=True, token_dispatcher_type=self.token_dispatcher_type,
            router="sigmoid_bias", norm_topk_prob=self.norm_topk_prob,
            router_z_loss_coef=self.router_z_loss_coef,
            router_bias_update_rate=self.router_bias_update_rate,
        )  # fmt: skip

    @property
    def moe_variant(self) -> MoEVariant:
        return MoEVariant(self.n_group, self.topk_group, self.routed_scaling_factor, "relu2")

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


def _moe_error(c: Mamba2HybridConfig) -> str | None:
    """The first refused `E` key, named as the YAML names it (NemotronHConfig's keys)."""
    m = c.moe_config
    if m is None:
        return None
    if c.moe_latent_size is not None:
        return f"{_MC}.moe_latent_size: the latent projection is not supported (null)"
    for name in ("n_group", "topk_group", "moe_shared_expert_intermediate_size"):
        if not _int(getattr(c, name)):
            return f"{_MC}.{name} must be a positive integer, got {getattr(c, name)!r}"
    e, g = c.n_routed_experts, c.n_group
    if _int(e) and (e % g or c.topk_group > g):
        return (f"{_MC}.n_group ({g}) must divide n_routed_experts ({e}) and be at least "
                f"topk_group ({c.topk_group})")  # fmt: skip
    if _int(e) and c.num_experts_per_tok > c.topk_group * (e // g):
        return (f"{_MC}.num_experts_per_tok ({c.num_experts_per_tok}) is more than the experts "
                f"of topk_group groups ({c.topk_group * (e // g)})")  # fmt: skip
    if not isinstance(c.routed_scaling_factor, (int, float)) or c.routed_scaling_factor <= 0:
        return f"{_MC}.routed_scaling_factor must be a positive number"
    names = {"num_experts": "n_routed_experts", "top_k": "num_experts_per_tok",
             "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size"}  # fmt: skip
    error = moe_config_error(m, c.num_hidden_layers)
    if error is None:
        return None
    key = error.split(" ", 1)[0].rsplit(".", 1)[-1]
    return f"{_MC}.{names.get(key, key)} {error.split(' ', 1)[1]}"


MOE_CHECKS = (
    _row(lambda c, tp: _moe_error(c) is None, lambda c, tp: _moe_error(c)),
)  # fmt: skip


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
    *MOE_CHECKS,
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
