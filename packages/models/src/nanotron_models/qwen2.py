"""Nanotron's Qwen2 family (the architecture SmolLM3 is trained with): its config and checks.

The blocks are Llama's (RMSNorm, RoPE, GQA, SwiGLU, built from the same parallel primitives);
what differs is said by the config's answers to `DecoderConfig`'s questions:

- `attention_bias`: biases on q, k and v only (Qwen2's layout), none on the output projection;
- `no_rope_layer: N`: every N-th layer (layers N-1, 2N-1, ... counting from 0) has no rotary
  embedding (NoPE, as SmolLM3 and Llama 4), and attends without a sliding window (Nanotron
  drops the window on those layers);
- `sliding_window_size: W`: every other layer's query sees itself and the W-1 keys before it;
- `_use_doc_masking` or `flex_attention_mask` naming `document`: attention stays inside each
  document of a packed sequence (the data gives the boundaries: positions restart at 0);
- `rope_seq_len_interpolation_factor: f`: positions divided by f before RoPE (position
  interpolation; Hugging Face's `rope_type: linear`).

Every key of Nanotron's `Qwen2Config` is a field here with Nanotron's default; the kernel keys
are documented in docs/models.md and the ones this project cannot honour are refused by a row of
`QWEN2_CHECKS`, one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import (
    _MC,
    SHARED_CHECKS,
    DecoderConfig,
    ModelCheck,
    _positive_int,
    _positive_number,
)
from .moe.config import MoEConfig

# Nanotron's `_attn_implementation` values -> our kernels. flash_attention_2 (and Nanotron's
# context-parallel llama3_ring_attention, which is flash-attn varlen over gathered keys) run
# flash-attn on CUDA when installed, sdpa otherwise; masks (documents, windows) run flex
# attention on CUDA and sdpa with an explicit mask on the CPU (masks.py).
QWEN2_ATTENTION = {
    "flash_attention_2": "flash_attn",
    "llama3_ring_attention": "flash_attn",
    "sdpa": "sdpa",
    "flex_attention": "flex",
    None: "auto",
}
FLEX_MASKS = ("document", "sliding_window", "sliding_window_document")


@dataclass
class Qwen2Config(DecoderConfig):
    """Nanotron's `Qwen2Config`: its field names, order and defaults (`is_qwen2_config: true`
    is how a YAML names the family)."""

    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    hidden_act: str = "silu"
    hidden_size: int = 4096
    initializer_range: float = 0.02
    intermediate_size: int = 11008
    is_qwen2_config: bool = True
    max_position_embeddings: int = 2048
    num_attention_heads: int = 32
    num_hidden_layers: int = 32
    num_key_value_heads: int | None = None
    pad_token_id: int | None = None
    pretraining_tp: int = 1
    rms_norm_eps: float = 1e-6
    rope_scaling: dict[str, Any] | None = None
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    rope_seq_len_interpolation_factor: float | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = True
    vocab_size: int = 32000
    _attn_implementation: str | None = "flash_attention_2"
    flex_attention_mask: str | None = None
    attention_bias: bool = False
    sliding_window_size: int | None = None
    z_loss_enabled: bool = False
    z_loss_coefficient: float = 0.0001
    no_rope_layer: int | None = None
    # Kernel choices (docs/models.md): the fused RMSNorm and rotary autograd functions, or the
    # plain PyTorch ops (same values up to float rounding). q, k, v are always one projection.
    _fused_rotary_emb: bool = True
    _fused_rms_norm: bool = True
    _use_qkv_packed: bool = True
    _use_doc_masking: bool = False
    # Nanotron keeps flash-attn's softmax statistics for its metrics_logging detail logs, which
    # are refused here: nothing reads them, whatever the value.
    log_attn_probs: bool = True
    # Nanotron's llama3_ring_attention gathers this many kv heads per round (a memory bound);
    # the all-gather here takes every kv head at once, which computes the same.
    ring_attn_heads_k_stride: int | None = None
    # Mixture-of-experts layers (moe/config.py: Nanotron's MoEConfig keys and ours).
    moe_config: MoEConfig | None = None
    # Ours, as Llama's: which attention kernel ("auto": from _attn_implementation).
    attn_backend: str = "auto"

    NANOTRON_ATTENTION = QWEN2_ATTENTION

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.moe_config = MoEConfig.of(self.moe_config)  # a checkpoint's or HF's mapping

    def checks(self) -> tuple[ModelCheck, ...]:
        return QWEN2_CHECKS

    @property
    def document_masking(self) -> bool:
        mask = self.flex_attention_mask or ""
        return bool(self._use_doc_masking) or mask.endswith("document")

    @property
    def o_proj_bias(self) -> bool:
        return False

    @property
    def rope_interpolation(self) -> float | None:
        return self.rope_seq_len_interpolation_factor

    def uses_rope(self, layer: int) -> bool:
        n = self.no_rope_layer
        return n is None or (layer + 1) % n != 0

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_window_size if self.uses_rope(layer) else None


def _row(holds, message) -> ModelCheck:
    return ModelCheck(holds, message)


def _optional(value: Any, ok) -> bool:
    return value is None or ok(value)


def _flex_mask_error(c: Qwen2Config) -> str | None:
    mask = c.flex_attention_mask
    if mask is None:
        return None
    if mask not in FLEX_MASKS:
        return f"{_MC}.flex_attention_mask must be null or one of {list(FLEX_MASKS)}, got {mask!r}"
    if c._attn_implementation != "flex_attention":
        return (
            f"{_MC}.flex_attention_mask is set but _attn_implementation is "
            f"{c._attn_implementation!r}: it names a mask of flex_attention (as in Nanotron)"
        )
    if mask.startswith("sliding_window") and c.sliding_window_size is None:
        return f"{_MC}.flex_attention_mask {mask!r} needs sliding_window_size"
    if mask == "document" and c.sliding_window_size is not None:
        return (
            f"{_MC}.flex_attention_mask 'document' has no window but sliding_window_size is "
            f"{c.sliding_window_size}: use 'sliding_window_document'"
        )
    return None


def _ring_stride_error(c: Qwen2Config, tp: int) -> str | None:
    stride = c.ring_attn_heads_k_stride
    if c._attn_implementation != "llama3_ring_attention":
        if stride is None:
            return None
        return (
            f"{_MC}.ring_attn_heads_k_stride is {stride} but _attn_implementation is "
            f"{c._attn_implementation!r}: it belongs to llama3_ring_attention (as in Nanotron)"
        )
    local = c.n_kv_heads // tp
    if not _positive_int(stride) or local % stride != 0:
        return (
            f"{_MC}.ring_attn_heads_k_stride must divide the {local} key/value heads of a tp "
            f"rank under llama3_ring_attention, got {stride!r}"
        )
    return None


QWEN2_CHECKS: tuple[ModelCheck, ...] = (
    *SHARED_CHECKS,
    _row(
        lambda c, tp: c.is_qwen2_config is True,
        lambda c, tp: f"{_MC}.is_qwen2_config must be true in a Qwen2 config",
    ),
    _row(
        lambda c, tp: c._attn_implementation in QWEN2_ATTENTION,
        lambda c, tp: (
            f"{_MC}._attn_implementation must be one of "
            f"{[k for k in QWEN2_ATTENTION if k]} or null, got {c._attn_implementation!r}"
        ),
    ),
    _row(lambda c, tp: _flex_mask_error(c) is None, lambda c, tp: _flex_mask_error(c)),
    _row(
        lambda c, tp: _optional(c.sliding_window_size, _positive_int),
        lambda c, tp: (
            f"{_MC}.sliding_window_size must be null or a positive integer, "
            f"got {c.sliding_window_size!r}"
        ),
    ),
    _row(
        lambda c, tp: _optional(c.no_rope_layer, _positive_int),
        lambda c, tp: (
            f"{_MC}.no_rope_layer must be null or a positive integer, got {c.no_rope_layer!r}"
        ),
    ),
    _row(
        lambda c, tp: c.no_rope_layer is None or c.num_hidden_layers % c.no_rope_layer == 0,
        lambda c, tp: (
            f"{_MC}.no_rope_layer ({c.no_rope_layer}) must divide num_hidden_layers "
            f"({c.num_hidden_layers}), as in Nanotron"
        ),
    ),
    _row(
        lambda c, tp: _optional(c.rope_seq_len_interpolation_factor, _positive_number),
        lambda c, tp: (
            f"{_MC}.rope_seq_len_interpolation_factor must be null or a positive number, "
            f"got {c.rope_seq_len_interpolation_factor!r}"
        ),
    ),
    _row(
        lambda c, tp: c.rope_scaling is None or c.rope_seq_len_interpolation_factor is None,
        lambda c, tp: (
            f"{_MC}.rope_seq_len_interpolation_factor and rope_scaling are both set: "
            "choose one way of stretching positions"
        ),
    ),
    _row(
        lambda c, tp: c._use_qkv_packed is True,
        lambda c, tp: (
            f"{_MC}._use_qkv_packed: false asks for separate q, k, v projections, which Nanotron "
            "does not run either (its unpacked path is commented out); set it to true"
        ),
    ),
    *(
        _row(
            lambda c, tp, n=name: isinstance(getattr(c, n), bool),
            lambda c, tp, n=name: f"{_MC}.{n} must be true or false, got {getattr(c, n)!r}",
        )
        for name in ("_fused_rotary_emb", "_fused_rms_norm", "_use_doc_masking", "log_attn_probs")
    ),
    _row(lambda c, tp: _ring_stride_error(c, tp) is None, _ring_stride_error),
)
