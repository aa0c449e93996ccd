"""The Qwen3-Next family's config: Hugging Face `Qwen3NextConfig`'s keys, names and defaults.

Each decoder layer is two residual layers, a mixer then a feed-forward; in the layer-pattern
notation of the hybrids (Megatron's, Nemotron-H's) that is two letters per layer:
`G` Gated DeltaNet (HF's `linear_attention`, mixers/gated_deltanet.py) or `*` gated full
attention (HF's `full_attention`: q_proj emits the query and a sigmoid output gate per head,
q/k RMSNorm per head, rotary on the first `partial_rotary_factor` of each head), then `E`
mixture of experts with a gated shared expert (our moe/ block) or `-` a dense SwiGLU MLP.
`pattern` spells the model that way ("G-G-G-*E" ...); HF's `layer_types` (or, absent, every
`full_attention_interval`-th layer full attention) and its sparse-layer keys
(`num_experts`, `decoder_sparse_step`, `mlp_only_layers`) say which letter each layer has.
Every norm but the gated one is zero-centred: it scales by (1 + weight), weight initialised 0.

`is_qwen3_next_config: true` names the family in a YAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import DecoderConfig, ModelCheck
from ..moe.config import MoEConfig, moe_config_error

LAYER_TYPES = {"linear_attention": "G", "full_attention": "*"}
_MC = "model_config"


@dataclass
class Qwen3NextConfig(DecoderConfig):
    """HF `Qwen3NextConfig`'s fields and defaults (Qwen3-Next-80B-A3B), plus ours at the end."""

    is_qwen3_next_config: bool = True
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    # the Gated DeltaNet layers
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # the feed-forwards: layer i is sparse unless num_experts is 0, i is in mlp_only_layers or
    # (i + 1) is not a multiple of decoder_sparse_step (HF's rule)
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] = field(default_factory=list)
    layer_types: list[str] | None = None  # None: from full_attention_interval
    full_attention_interval: int = 4
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # ours, as every family
    linear_chunk_size: int = 64  # the chunked delta rule's chunk (results do not depend on it)
    moe_token_dispatcher_type: str = "alltoall"  # how tokens reach other ranks' experts (ep)
    _use_doc_masking: bool = False  # packed documents: attention masks and state resets
    attn_backend: str = "auto"
    _attn_implementation: str | None = None
    z_loss_enabled: bool = False
    z_loss_coefficient: float = 0.0001
    _fused_rms_norm: bool = True

    def __post_init__(self) -> None:
        if self.layer_types is None and isinstance(self.full_attention_interval, int):
            n, every = self.num_hidden_layers, max(self.full_attention_interval, 1)
            self.layer_types = [
                "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
            ]
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []

    def checks(self) -> tuple[ModelCheck, ...]:
        return QWEN3_NEXT_CHECKS

    # ---- the layers ----
    def mixer_kind(self, layer: int) -> str:
        """'G' (Gated DeltaNet) or '*' (gated attention) for decoder layer `layer`."""
        return LAYER_TYPES[self.layer_types[layer]]

    def sparse_layers(self) -> list[int]:
        """The decoder layers whose feed-forward is a mixture of experts (HF's rule)."""
        if not self.num_experts:
            return []
        step, dense = self.decoder_sparse_step, set(self.mlp_only_layers)
        n = self.num_hidden_layers
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]

    def ffn_kind(self, layer: int) -> str:
        return "E" if layer in self.sparse_layers() else "-"

    @property
    def pattern(self) -> str:
        """Two letters per decoder layer: its mixer (G, *) and its feed-forward (E, -)."""
        return "".join(self.mixer_kind(i) + self.ffn_kind(i) for i in range(self.num_hidden_layers))

    @property
    def moe_config(self) -> MoEConfig | None:
        """The sparse layers as our MoE block reads them (None: every layer dense)."""
        sparse = self.sparse_layers()
        if not sparse:
            return None
        shared = self.shared_expert_intermediate_size
        return MoEConfig(
            num_experts=self.num_experts, top_k=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            shared_expert_intermediate_size=shared or 1, enable_shared_expert=bool(shared),
            router_aux_loss_coef=self.router_aux_loss_coef, layers=sparse,
            token_dispatcher_type=self.moe_token_dispatcher_type,
            norm_topk_prob=self.norm_topk_prob,
        )  # fmt: skip

    # ---- what the gated attention reads ----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def o_proj_bias(self) -> bool:
        return bool(self.attention_bias)


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


def _divides(key: str, of: str, what: str = "") -> ModelCheck:
    """A row: `key` is divisible by the key `of` (or by tp when `of` is 'tp')."""
    return _row(
        lambda c, tp: getattr(c, key) % (tp if of == "tp" else getattr(c, of)) == 0,
        lambda c, tp: (
            f"{_MC}.{key} ({getattr(c, key)}) must be divisible by "
            + (f"tp ({tp})" if of == "tp" else f"{of} ({getattr(c, of)})")
            + what
        ),
    )


def _token_ok(c: Qwen3NextConfig, name: str) -> bool:
    value = getattr(c, name)
    return value is None or (isinstance(value, int) and 0 <= value < c.vocab_size)


def _has(c: Qwen3NextConfig, letter: str) -> bool:
    return letter in c.pattern


# Rows run in order (a row may assume those above passed); each names its key.
QWEN3_NEXT_CHECKS: tuple[ModelCheck, ...] = (
    *_ints("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
           "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
           "linear_chunk_size", "decoder_sparse_step", "max_position_embeddings"),
    _row(lambda c, tp: _int(tp), lambda c, tp: f"tensor parallel size must be positive, got {tp!r}"),
    _row(lambda c, tp: isinstance(c.layer_types, list) and len(c.layer_types) == c.num_hidden_layers,
         lambda c, tp: f"{_MC}.layer_types must list num_hidden_layers ({c.num_hidden_layers}) "
                       f"entries, got {c.layer_types!r}"),
    _row(lambda c, tp: set(c.layer_types) <= set(LAYER_TYPES),
         lambda c, tp: f"{_MC}.layer_types: each must be linear_attention or full_attention, got "
                       f"{sorted(set(c.layer_types) - set(LAYER_TYPES))}"),
    _row(lambda c, tp: isinstance(c.mlp_only_layers, list)
         and all(isinstance(i, int) and 0 <= i < c.num_hidden_layers for i in c.mlp_only_layers),
         lambda c, tp: f"{_MC}.mlp_only_layers must list layers in 0..{c.num_hidden_layers - 1}, "
                       f"got {c.mlp_only_layers!r}"),
    _row(lambda c, tp: c.hidden_act == "silu",
         lambda c, tp: f"{_MC}.hidden_act must be 'silu' (Qwen3-Next's), got {c.hidden_act!r}"),
    _divides("num_attention_heads", "num_key_value_heads"),
    _row(lambda c, tp: not _has(c, "*") or c.num_key_value_heads % tp == 0,
         lambda c, tp: f"{_MC}.num_key_value_heads ({c.num_key_value_heads}) must be divisible "
                       f"by tp ({tp})"),
    _row(lambda c, tp: 0 < c.partial_rotary_factor <= 1 and c.rotary_dim % 2 == 0,
         lambda c, tp: f"{_MC}.partial_rotary_factor ({c.partial_rotary_factor}) must be in "
                       "(0, 1] and give an even number of rotated dims of head_dim"),
    _divides("linear_num_value_heads", "linear_num_key_heads"),
    _row(lambda c, tp: not _has(c, "G") or c.linear_num_key_heads % tp == 0,
         lambda c, tp: f"{_MC}.linear_num_key_heads ({c.linear_num_key_heads}) must be divisible "
                       f"by tp ({tp}) (each rank keeps whole key heads and their value heads)"),
    _row(lambda c, tp: not _has(c, "-") or (_int(c.intermediate_size)
                                            and c.intermediate_size % tp == 0),
         lambda c, tp: f"{_MC}.intermediate_size ({c.intermediate_size}) must be a positive "
                       f"multiple of tp ({tp})"),
    _row(lambda c, tp: c.moe_config is None or moe_config_error(c.moe_config,
                                                                c.num_hidden_layers) is None,
         lambda c, tp: moe_config_error(c.moe_config, c.num_hidden_layers)
         .replace("moe_config.top_k", "num_experts_per_tok").replace("moe_config.", "")),
    _row(lambda c, tp: c.moe_config is None or c.shared_expert_intermediate_size % tp == 0,
         lambda c, tp: f"{_MC}.shared_expert_intermediate_size "
                       f"({c.shared_expert_intermediate_size}) must be divisible by tp ({tp})"),
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
