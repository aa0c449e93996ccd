"""Greedy decoding with a KV cache (the building block of generation; sampling comes later)."""

from __future__ import annotations

import torch

from .kv_cache import KVCache


@torch.no_grad()
def greedy_generate(
    stage, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None
) -> torch.Tensor:
    """Prompt `input_ids` [b, s] followed by up to `max_new_tokens` greedy tokens.

    One forward over the prompt fills the cache, then one token per step. Every tp rank runs
    it with the same prompt and gets the same tokens (the logits are gathered over tp).
    Stops early when every sequence has produced `eos_token_id`; finished rows are then
    padded with it, like Hugging Face's generate.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cache = KVCache()
    out = input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    new = input_ids
    for _ in range(max_new_tokens):
        logits = stage.logits(new, kv_cache=cache)
        token = logits[:, -1].argmax(dim=-1)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done |= token == eos_token_id
        out = torch.cat((out, token[:, None]), dim=1)
        new = token[:, None]
        if eos_token_id is not None and bool(done.all()):
            break
    return out
