"""The Llama configuration (Nanotron's field names) and its validation, a table of rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .errors import ModelConfigError

# The dtype names of configs and checkpoints (`model.dtype`), in one place.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# flex: torch flex_attention (compiled; block-sparse masks), see masks.py.
ATTN_BACKENDS = ("auto", "sdpa", "flash_attn", "flex")
# Nanotron's `_attn_implementation` values -> our backends; the others are refused.
# llama3_ring_attention is Nanotron's context-parallel attention over flash-attn; with
# parallelism.cp_attention null it selects the ring here (nanotron_train.config.context_parallel).
NANOTRON_ATTENTION = {
    "flash_attention_2": "flash_attn",
    "llama3_ring_attention": "flash_attn",
    "sdpa": "sdpa",
    None: "auto",
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class DecoderConfig:
    """What every family's config answers (no fields: each family's dataclass has its own,
    with Nanotron's names and defaults). The per-layer questions (`uses_rope`,
    `sliding_window`) and `document_masking` are how the blocks learn the family's attention."""

    NANOTRON_ATTENTION: ClassVar[dict] = {}

    def checks(self) -> tuple[ModelCheck, ...]:
        raise NotImplementedError

    @property
    def attention_backend(self) -> str:
        """The backend to use: attn_backend when set, else Nanotron's _attn_implementation."""
        if self.attn_backend != "auto":
            return self.attn_backend
        return self.NANOTRON_ATTENTION.get(self._attn_implementation, "auto")

    @property
    def z_loss_weight(self) -> float:
        return self.z_loss_coefficient if self.z_loss_enabled else 0.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @property
    def document_masking(self) -> bool:
        """Attention stays inside each document of a packed sequence (positions restart)."""
        return bool(self._use_doc_masking)

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention's output projection has a bias (Llama: attention_bias)."""
        return bool(self.attention_bias)

    @property
    def rope_interpolation(self) -> float | None:
        """Position interpolation factor (positions divided by it before RoPE), or None."""
        return None

    def uses_rope(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) rotates q and k (False: a NoPE layer)."""
        return True

    def sliding_window(self, layer: int) -> int | None:
        """How many keys (itself included) each query of `layer` sees at most, or None."""
        return None

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocab rounded up to a multiple of tp (the extra rows are zero and masked in the loss)."""
        return -(-self.vocab_size // tp) * tp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ModelConfigError(f"model_config: unknown key(s) {unknown}")
        return cls(**d)

    def validate(self, tp: int = 1):
        """Check every field (and compatibility with `tp`) against the family's check rows,
        in order; raise ModelConfigError naming the field of the first that fails."""
        for check in self.checks():
            if not check.holds(self, tp):
                raise ModelConfigError(check.message(self, tp))
        return self


@dataclass
class LlamaConfig(DecoderConfig):
    """Llama hyper-parameters, with the names Nanotron's YAML uses under `model.model_config`.

    `rope_scaling` is None (plain RoPE) or a Llama-3 scaling dict:
    `{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}`.

    Tensor parallelism splits the attention heads and the key/value heads over the tp ranks, so
    `num_key_value_heads` must be a multiple of tp. We refuse `num_key_value_heads < tp` rather
    than replicating key/value heads across ranks: replication would make the k/v weights
    layout-dependent and break topology-independent initialisation and checkpoints.
    """

    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None
    # Accepted for compatibility with Nanotron YAML files; only the values below are supported.
    is_llama_config: bool = True
    pretraining_tp: int = 1
    use_cache: bool = True
    rope_interleaved: bool = False
    # Biases on the q, k, v and o projections (Hugging Face Llama's meaning), initialised to 0.
    attention_bias: bool = False
    # Nanotron's attention kernel name: flash_attention_2 (flash_attn, sdpa where it cannot
    # run), sdpa, or null (auto). `attn_backend` (ours), when not "auto", takes precedence.
    _attn_implementation: str | None = "flash_attention_2"
    # z-loss (PaLM): coefficient * logsumexp(logits)^2 added to each token's loss.
    z_loss_enabled: bool = False
    z_loss_coefficient: float = 0.0001
    # Ours: which attention kernel to use ("auto" = flash_attn on CUDA when installed, else sdpa).
    attn_backend: str = "auto"

    # Ours (Nanotron's Qwen2 key): attention stays inside each document of a packed sequence,
    # whose boundaries the data gives (position ids restarting at 0).
    _use_doc_masking: bool = False
    # Ours (Nanotron's Qwen2 key): mixture-of-experts layers, Mixtral-like (moe/config.py's
    # MoEConfig; Hugging Face's MixtralForCausalLM when every layer is one, hf_mixtral.py).
    moe_config: Any = None

    NANOTRON_ATTENTION = NANOTRON_ATTENTION

    def __post_init__(self) -> None:
        # Imported when used: importing the moe package runs its __init__, whose blocks build
        # on this module's classes (moe/config.py itself needs only errors.py).
        from .moe.config import MoEConfig

        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.moe_config = MoEConfig.of(self.moe_config)  # a checkpoint's or HF's mapping

    def checks(self) -> tuple[ModelCheck, ...]:
        return LLAMA_CHECKS


@dataclass(frozen=True)
class ModelCheck:
    """One row: `holds(config, tp)`, else the error `message(config, tp)` (it names the field).
    Rows run in order, so a row may assume the ones above it passed."""

    holds: Callable[[Any, int], bool]
    message: Callable[[Any, int], str]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _field_rows(names: tuple[str, ...], ok: Callable[[Any], bool], kind: str) -> list[ModelCheck]:
    return [
        ModelCheck(
            lambda c, tp, n=name: ok(getattr(c, n)),
            lambda c, tp, n=name: f"model_config.{n} must be {kind}, got {getattr(c, n)!r}",
        )
        for name in names
    ]


def _token_id_ok(c: LlamaConfig, name: str) -> bool:
    value = getattr(c, name)
    return value is None or (isinstance(value, int) and 0 <= value < c.vocab_size)


_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)
_POSITIVE = ("rms_norm_eps", "rope_theta", "initializer_range")
_MC = "model_config"

# The rows every family shares (Qwen2 adds its own after them).
SHARED_CHECKS: tuple[ModelCheck, ...] = (
    *_field_rows(_SIZES, _positive_int, "a positive integer"),
    *_field_rows(_POSITIVE, _positive_number, "a positive number"),
    ModelCheck(
        lambda c, tp: isinstance(tp, int) and tp > 0,
        lambda c, tp: f"tensor parallel size must be a positive integer, got {tp!r}",
    ),
    ModelCheck(
        lambda c, tp: c.hidden_size % c.num_attention_heads == 0,
        lambda c, tp: (
            f"{_MC}.hidden_size ({c.hidden_size}) must be divisible by "
            f"{_MC}.num_attention_heads ({c.num_attention_heads})"
        ),
    ),
    ModelCheck(
        lambda c, tp: c.head_dim % 2 == 0,
        lambda c, tp: f"{_MC}.hidden_size / num_attention_heads = {c.head_dim} must be even (RoPE)",
    ),
    ModelCheck(
        lambda c, tp: c.num_attention_heads % c.n_kv_heads == 0,
        lambda c, tp: (
            f"{_MC}.num_attention_heads ({c.num_attention_heads}) must be divisible by "
            f"{_MC}.num_key_value_heads ({c.n_kv_heads})"
        ),
    ),
    ModelCheck(
        lambda c, tp: c.num_attention_heads % tp == 0,
        lambda c, tp: (
            f"{_MC}.num_attention_heads ({c.num_attention_heads}) must be divisible by tp ({tp})"
        ),
    ),
    ModelCheck(
        lambda c, tp: c.n_kv_heads >= tp,
        lambda c, tp: (
            f"{_MC}.num_key_value_heads ({c.n_kv_heads}) is smaller than tp ({tp}): each tp rank "
            f"needs at least one key/value head (we do not replicate kv heads); "
            f"use tp <= {c.n_kv_heads} or more key/value heads"
        ),
    ),
    ModelCheck(
        lambda c, tp: c.n_kv_heads % tp == 0,
        lambda c, tp: f"{_MC}.num_key_value_heads ({c.n_kv_heads}) must be divisible by tp ({tp})",
    ),
    ModelCheck(
        lambda c, tp: c.intermediate_size % tp == 0,
        lambda c, tp: (
            f"{_MC}.intermediate_size ({c.intermediate_size}) must be divisible by tp ({tp})"
        ),
    ),
    ModelCheck(
        lambda c, tp: c.hidden_act == "silu",
        lambda c, tp: f"{_MC}.hidden_act must be 'silu' (SwiGLU), got {c.hidden_act!r}",
    ),
    ModelCheck(
        lambda c, tp: c.attn_backend in ATTN_BACKENDS,
        lambda c, tp: f"{_MC}.attn_backend must be one of {ATTN_BACKENDS}, got {c.attn_backend!r}",
    ),
    ModelCheck(
        lambda c, tp: c.z_loss_coefficient >= 0,
        lambda c, tp: f"{_MC}.z_loss_coefficient must be >= 0, got {c.z_loss_coefficient}",
    ),
    ModelCheck(
        lambda c, tp: not c.rope_interleaved,
        lambda c, tp: (
            f"{_MC}.rope_interleaved: true is not supported (we use the rotate-half "
            "layout of Hugging Face)"
        ),
    ),
    ModelCheck(
        lambda c, tp: bool(c.use_cache),
        lambda c, tp: (
            f"{_MC}.use_cache: false asks for generation without a KV cache, which "
            "this project does not have; set it to true"
        ),
    ),
    ModelCheck(
        lambda c, tp: c.pretraining_tp == 1,
        lambda c, tp: f"{_MC}.pretraining_tp must be 1, got {c.pretraining_tp!r}",
    ),
    *(
        ModelCheck(
            lambda c, tp, n=name: _token_id_ok(c, n),
            lambda c, tp, n=name: (
                f"{_MC}.{n} must be None or in [0, vocab_size={c.vocab_size}), "
                f"got {getattr(c, n)!r}"
            ),
        )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
    ),
    ModelCheck(
        lambda c, tp: _rope_scaling_error(c.rope_scaling) is None,
        lambda c, tp: _rope_scaling_error(c.rope_scaling),
    ),
    ModelCheck(lambda c, tp: _moe_error(c) is None, lambda c, tp: _moe_error(c)),
)

LLAMA_CHECKS: tuple[ModelCheck, ...] = (
    *SHARED_CHECKS,
    ModelCheck(
        lambda c, tp: c._attn_implementation in NANOTRON_ATTENTION,
        lambda c, tp: (
            f"{_MC}._attn_implementation {c._attn_implementation!r} asks for an "
            "attention kernel this project does not have: use flash_attention_2, sdpa, "
            "null, or llama3_ring_attention (flash-attn, and the ring attention under "
            "context parallel; flex attention is attn_backend: flex)"
        ),
    ),
    ModelCheck(
        lambda c, tp: bool(c.is_llama_config),
        lambda c, tp: (
            f"{_MC}.is_llama_config is false: a Llama config says true (a Qwen2 config "
            "says is_qwen2_config: true instead)"
        ),
    ),
    ModelCheck(
        lambda c, tp: isinstance(c._use_doc_masking, bool),
        lambda c, tp: f"{_MC}._use_doc_masking must be true or false, got {c._use_doc_masking!r}",
    ),
)


def _moe_error(c) -> str | None:
    """What is wrong with `moe_config` (None: nothing, or a dense model)."""
    from .moe.config import moe_config_error  # when used: see LlamaConfig.__post_init__

    return None if c.moe_config is None else moe_config_error(c.moe_config, c.num_hidden_layers)


def _rope_scaling_error(rs: dict[str, Any] | None) -> str | None:
    """What is wrong with `rope_scaling` (None: nothing)."""
    if rs is None:
        return None
    if not isinstance(rs, dict):
        return f"model_config.rope_scaling must be null or a mapping, got {rs!r}"
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "llama3":
        return (
            f"model_config.rope_scaling.rope_type must be 'llama3' (the only scaling supported), "
            f"got {kind!r}"
        )
    for key in _LLAMA3_KEYS:
        value = rs.get(key)
        if not _positive_number(value):
            return f"model_config.rope_scaling.{key} must be a positive number, got {value!r}"
    if rs["high_freq_factor"] <= rs["low_freq_factor"]:
        return (
            "model_config.rope_scaling.high_freq_factor must be greater than low_freq_factor, "
            f"got {rs['high_freq_factor']} <= {rs['low_freq_factor']}"
        )
    unknown = set(rs) - {"rope_type", "type", *_LLAMA3_KEYS}
    if unknown:
        return f"model_config.rope_scaling: unknown key(s) {sorted(unknown)}"
    return None
