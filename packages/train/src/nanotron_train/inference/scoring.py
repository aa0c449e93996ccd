"""Scores of token sequences under a model: the log-likelihood of each sequence's last tokens
and whether greedy decoding would have produced them (what an evaluation harness asks for
multiple choice and perplexity).

A batch of sequences of different lengths is right-padded to one length and run in one
forward without a mask: attention is causal (and a state-space mixer runs left to right), so a
real token never sees the padding after it and its logits are those of the sequence alone.
Log-probabilities are taken in float32 (log_softmax of the whole vocabulary, gathered over
tp). Any layout: a model held whole calls `logits`; a pipeline stage or chunks runs the
stages (pipelined_decoding.py) and the last one's scores are broadcast over the pp group, so
every rank of the replica returns the same list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanotron_train.inference.decoding import holds_whole_model
from nanotron_train.inference.pipelined_decoding import from_last_stage, pipelined_logits


@dataclass(frozen=True)
class ScoreRequest:
    """`tokens` is the model's input followed by one more token; the last `scored` tokens are
    the ones whose log-likelihood is summed (each predicted from the tokens before it)."""

    tokens: list[int]
    scored: int


def _batch_logits(stage, ids: torch.Tensor) -> torch.Tensor | None:
    """Logits [b, s, vocab] of `ids` [b, s] (on the last pp rank; None on the others)."""
    if holds_whole_model(stage):
        return stage.logits(ids)
    return pipelined_logits(stage, ids)


def _scores(logits: torch.Tensor, batch: list[ScoreRequest]) -> torch.Tensor:
    """[b, 2] float64: (sum of the scored tokens' log-probabilities, 1.0 if all are greedy)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = torch.empty(len(batch), 2, dtype=torch.float64, device=logits.device)
    for row, req in enumerate(batch):
        n = len(req.tokens) - 1  # input length: positions n - scored .. n - 1 predict them
        target = torch.tensor(req.tokens[n - req.scored + 1 :], device=logits.device)
        picked = logp[row, n - req.scored : n]
        out[row, 0] = picked.gather(-1, target[:, None]).sum().double()
        out[row, 1] = float(bool((picked.argmax(-1) == target).all()))
    return out


@torch.no_grad()
def score(stage, requests: list[ScoreRequest], pad_token_id: int = 0) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each request, the requests run as one right-padded batch;
    collective over the tp and pp groups (every rank passes the same requests)."""
    for req in requests:
        if not 1 <= req.scored < len(req.tokens):
            raise ValueError(f"a score request needs 1 <= scored < {len(req.tokens)} tokens")
    device = next(stage.parameters()).device
    width = max(len(r.tokens) for r in requests) - 1
    ids = torch.full((len(requests), width), pad_token_id, dtype=torch.long, device=device)
    for row, req in enumerate(requests):
        ids[row, : len(req.tokens) - 1] = torch.tensor(req.tokens[:-1], device=device)
    logits = _batch_logits(stage, ids)
    scores = _scores(logits, requests) if logits is not None else None
    like = torch.empty(len(requests), 2, dtype=torch.float64, device=device)
    scores = from_last_stage(stage.pc, scores, like)
    return [(float(s), bool(g)) for s, g in scores.tolist()]
