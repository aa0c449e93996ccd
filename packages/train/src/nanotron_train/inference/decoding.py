"""Batched decoding of prompts of different lengths with the family's decoding state (a KV
cache for attention; any tp; a model split over pp stages or interleaved chunks runs each step
through pipelined_decoding.py). Any family: the stage is reached through its declared
interface (nanotron_models.stage) and the decoding state made by the family's row.

Prompts are left-padded to one length. Each sequence keeps its own positions (0 at its first
real token, as Hugging Face computes them from the attention mask) and a key mask hides the
padding from every query, so a prompt's tokens do not depend on the others in the batch.

The stage's `logits` takes that key mask and the per-sequence positions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanotron_models.families import family_of
from nanotron_models.stage import ModelStage
from nanotron_train.inference.sampling import SamplingParams, make_generator, next_tokens


class DecodingError(ValueError):
    """Prompts or lengths that cannot be decoded; the message names the option."""


@dataclass
class GenerationResult:
    """Per prompt: the new token ids (up to and including EOS); timings of the two phases."""

    tokens: list[list[int]]
    prompt_tokens: int = 0  # real (unpadded) prompt tokens in the batch
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0  # tokens of unfinished rows made by the steps after the prefill
    steps: list[float] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def _agree(tokens: torch.Tensor, pc) -> torch.Tensor:
    """Every tp rank takes tp rank 0's tokens (sampling is seeded alike; this makes it certain),
    then every ep rank ep rank 0's: under expert parallelism the ranks of one ep group decode
    the same batch together (each MoE layer dispatches over them), and an expert's grouped
    matmul over both ranks' rows need not round each row alike."""
    if pc.tp_size > 1:
        dist.broadcast(tokens, src=pc.tp_ranks[0], group=pc.tp_group)
    if pc.ep_size > 1:
        dist.broadcast(tokens, src=pc.ep_ranks[0], group=pc.ep_group)
    return tokens


def holds_whole_model(stage: ModelStage) -> bool:
    """Whether `stage` is one stage holding every block but the loss (pp = 1, no virtual
    chunks)."""
    if hasattr(stage, "chunks"):
        return False
    every = set(family_of(stage.config).block_names(stage.config)) - {"loss"}
    return every <= set(getattr(stage, "block_names", ()))


def _one_stage_step(stage):
    """The decoding step of a model held whole: logits of the new tokens, then `pick`."""

    def step(new, positions, cache, key_mask, pick):
        return pick(stage.logits(new, positions, cache, key_mask)[:, -1])

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pad_prompts(
    prompts: list[list[int]], max_new_tokens: int, pad_token_id: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids [b, L]; positions and key mask [b, L + max_new_tokens] (True = real)."""
    longest = max(len(p) for p in prompts)
    pads = torch.tensor([longest - len(p) for p in prompts], device=device)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p, dtype=torch.long, device=device)
    cols = torch.arange(longest + max_new_tokens, device=device)
    key_mask = cols[None, :] >= pads[:, None]
    positions = (cols[None, :] - pads[:, None]).clamp(min=0)  # 0 at each first real token
    return ids, positions, key_mask


def _check_request(stage, prompts: list[list[int]], max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise DecodingError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DecodingError("every prompt needs at least one token")
    limit = stage.config.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > limit:
        raise DecodingError(
            f"a prompt of {longest} tokens plus --max-new-tokens {max_new_tokens} exceeds "
            f"the model's max_position_embeddings ({limit})"
        )


def _forward_step(stage):
    """The decoding step of `stage`: one whole model, or a pipeline stage / chunks."""
    if holds_whole_model(stage):
        return _one_stage_step(stage)
    from nanotron_train.inference.pipelined_decoding import pipelined_step

    return pipelined_step(stage)


def _keep_unfinished(out: list[list[int]], token: torch.Tensor, done: torch.Tensor) -> int:
    """Append each unfinished row's new token to its output; returns how many were added."""
    added = 0
    for i, (t, finished) in enumerate(zip(token.tolist(), done.tolist())):  # waits for the device
        if not finished:
            out[i].append(t)
            added += 1
    return added


@torch.no_grad()
def generate(
    stage,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    stop: Callable[[list[int]], bool] | None = None,
) -> GenerationResult:
    """Continue every prompt (token ids) in one batch; collective over the tp group (and the
    pp group when `stage` is one pipeline stage or StageChunks, and the ep group when its
    experts are split over one: every rank of the replica calls it with the same arguments and
    gets the same result).

    Stops a row at EOS (kept in its output), or once `stop(its new tokens)` is true (a stop
    sequence: the caller cuts the text; every rank sees the same tokens, so all agree), and
    the batch when every row stopped or after `max_new_tokens`. Greedy when `sampling` is
    None or its temperature is 0.
    """
    sampling = (sampling or SamplingParams()).validate()
    _check_request(stage, prompts, max_new_tokens)
    device = next(stage.parameters()).device
    ids, positions, key_mask = pad_prompts(prompts, max_new_tokens, pad_token_id, device)
    generator = None if sampling.greedy else make_generator(sampling, device)
    cache = family_of(stage.config).new_decode_state(stage.config)
    out = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    result = GenerationResult(out, prompt_tokens=sum(len(p) for p in prompts))
    forward_step = _forward_step(stage)

    def pick(last_logits: torch.Tensor) -> torch.Tensor:  # [b, vocab] -> [b] token ids
        return _agree(next_tokens(last_logits, sampling, generator), stage.pc)

    new, start = ids, 0
    _sync(device)
    t0 = time.perf_counter()
    for step in range(max_new_tokens):
        end = start + new.shape[1]
        # key_mask [b, decoded so far + s] is True at real tokens, False at left padding
        token = forward_step(new, positions[:, start:end], cache, key_mask[:, :end], pick)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
        added = _keep_unfinished(out, token, done)
        if eos_token_id is not None:
            done |= token == eos_token_id
        if stop is not None:
            done |= torch.tensor([stop(row) for row in out], device=device)
        now = time.perf_counter()
        result.steps.append(now - t0)
        if step == 0:
            result.prefill_s = now - t0
        else:
            result.decode_tokens += added
        if bool(done.all()):
            break
        new, start = token[:, None], end
    result.decode_s = result.steps[-1] - result.prefill_s
    return result
