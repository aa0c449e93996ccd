"""Choosing the next token from logits: greedy (temperature 0) or sampled with top-k / top-p.

Sampling draws from a `torch.Generator` seeded once per generation, so a seed gives the same
tokens on every run; the caller broadcasts the choice over tp so every rank agrees bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """A sampling parameter out of range; the message names the option."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut
    seed: int = 0

    def validate(self) -> SamplingParams:
        if not self.temperature >= 0:
            raise SamplingError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"--top-p must be in (0, 1], got {self.top_p}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(params.seed)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits [b, vocab] with everything outside the top-k and the top-p nucleus set to -inf.

    The nucleus keeps the smallest set of most likely tokens whose probability reaches top_p
    (the most likely token is always kept), as Hugging Face's TopPLogitsWarper does.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """One token id per row of `logits` [b, vocab] (long [b])."""
    if params.greedy:
        return logits.argmax(dim=-1)
    scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = scaled.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
