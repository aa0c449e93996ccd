"""Attention kernels: flash-attn when available on CUDA, else PyTorch's scaled_dot_product_attention.

Tensors are sequence-first like the rest of the model: q [s_q, b, heads, d], k and v
[s_k, b, kv_heads, d] (grouped-query attention: heads is a multiple of kv_heads). Causality is
bottom-right aligned: query i sits at absolute position s_k - s_q + i, which is what decoding
with a KV cache needs (with s_q == s_k it is the ordinary causal mask).

Which kernel, and what is said about it: flash-attn is a CUDA kernel, so on a CPU sdpa is the
only choice and nothing is logged, whatever was asked (Nanotron's default
`_attn_implementation: flash_attention_2` asks for flash-attn in every config that does not
say otherwise; a warning there would be noise on every rank of every CPU run). On CUDA without
flash-attn installed, a request for it (that default included) is a warning and `auto` an info
line: once per process, from rank 0 only.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@functools.cache
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def _log_once(level: int, message: str) -> None:
    if _rank() == 0:
        logger.log(level, message)


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def resolve_backend(requested: str, device: torch.device) -> str:
    """Which kernel to run for `requested` in {"auto", "sdpa", "flash_attn"} on `device`:
    flash_attn where it can run (CUDA, installed), else sdpa (see the module docstring for
    what is logged)."""
    if requested not in ("auto", "sdpa", "flash_attn"):
        raise ValueError(f"unknown attention backend {requested!r}")
    if requested == "sdpa":
        return "sdpa"
    if device.type == "cuda" and flash_attn_available():
        return "flash_attn"
    if device.type == "cuda":  # a GPU without the flash-attn package
        level = logging.WARNING if requested == "flash_attn" else logging.INFO
        _log_once(level, f"attn_backend={requested}: flash_attn is not installed; using sdpa")
    return "sdpa"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention; returns [s_q, b, heads, d].

    `key_mask` [b, s_k] (True = a real token) hides left padding of batched prompts from every
    query; it is decoding's case and always runs through sdpa.
    """
    if backend == "flash_attn" and key_mask is None:
        from flash_attn import flash_attn_func

        # flash-attn wants [b, s, heads, d] and aligns the causal mask bottom-right.
        out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True)
        return out.transpose(0, 1)
    return _sdpa(q, k, v, key_mask)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    s_q, s_k = q.shape[0], k.shape[0]
    # [s, b, heads, d] -> [b, heads, s, d]; GQA without materialising repeated kv heads.
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if key_mask is not None:
        # Query i sits at key index s_k - s_q + i: it sees earlier real keys, and always itself
        # so that a padding row never has an empty softmax (its output is unused but finite).
        rows = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
        cols = torch.arange(s_k, device=q.device)[None, :]
        allowed = ((cols <= rows)[None] & key_mask[:, None, :]) | (cols == rows)[None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=gqa)
    elif s_q == s_k:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif s_q == 1:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    else:
        # Cached prefix: query i may see keys 0 .. s_k - s_q + i (bottom-right causal mask).
        rows = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
        mask = torch.arange(s_k, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.permute(2, 0, 1, 3)
