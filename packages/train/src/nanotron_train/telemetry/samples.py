"""Samples at checkpoints: rank 0's replica continues fixed prompts, greedily, with the KV cache.

When `logging.sample_prompts` is set, every checkpoint the ranks of dp rank 0 (its tp and pp
groups; with pp > 1 the steps are pipelined, pipelined_decoding.py; every cp rank decodes the
whole sequences alike, context parallel switched off meanwhile; under expert parallelism the
whole ep group of dp rank 0, dp ranks 0 to ep - 1, since each holds only its experts and every
MoE layer dispatches over all of them: they decode the same batch together) decode the prompts
in one batch with `decoding.generate` (nanotron_train/inference/decoding.py), and rank 0 logs them and sends a
`samples` message. Training is unchanged by it, bitwise: no gradient is made (no_grad), no RNG state
moves (greedy decoding draws nothing; `fork_rng` restores the generators anyway), the
parameters are only read, and the tp mode and context parallel the model trains with are
put back (decoding runs in
ALL_REDUCE mode: sequence parallelism cannot split one new token over tp).
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext

import torch

from nanotron_train.config.token_ids import generation_eos
from nanotron_train.inference.decoding import generate
from nanotron_train.inference.pipelined_decoding import stage_chunks

MAX_COMPLETION_CHARS = 16_000
# The dashboard refuses a message over 1 MiB; 64 prompts of 4,000 characters with completions of
# 16,000 would pass that (more so with non-ASCII text, which JSON escapes), so the completions
# are shortened until the samples fit this budget, leaving room for the envelope.
MAX_SAMPLES_JSON_BYTES = 960_000


def fit_samples(samples: list[dict], budget: int = MAX_SAMPLES_JSON_BYTES) -> list[dict]:
    """Shorten the longest completion by a quarter until the samples' JSON fits `budget` bytes
    (the prompts are bounded by the config check). Each completion is cut to at most
    MAX_COMPLETION_CHARS first."""
    out = [{**s, "completion": s["completion"][:MAX_COMPLETION_CHARS]} for s in samples]
    while len(json.dumps(out)) > budget:
        longest = max(out, key=lambda s: len(s["completion"]))
        if not longest["completion"]:
            break
        longest["completion"] = longest["completion"][: len(longest["completion"]) * 3 // 4]
    return out


class SampleMaker:
    def __init__(self, cfg, pc, model, tokenizer, grads=None) -> None:
        self.cfg, self.pc, self.model, self.tok = cfg, pc, model, tokenizer
        self.grads = grads  # ZeRO-3: full_parameters() gathers the model for the decoding
        self.prompts = list(cfg.logging.sample_prompts)
        self.max_new = cfg.logging.sample_max_new_tokens
        # The EOS generation stops at, as in `generate` and a Hugging Face export (token_ids.py).
        self.eos = generation_eos(cfg.model.model_config, tokenizer)
        # An empty encoding starts a new document: EOS is what precedes one in training data.
        self.ids = [tokenizer.encode(p) or [tokenizer.eos_token_id] for p in self.prompts]
        limit = model.config.max_position_embeddings
        longest = max(len(i) for i in self.ids)
        if longest + self.max_new > limit:
            raise ValueError(
                f"logging.sample_prompts: a prompt of {longest} tokens plus "
                f"logging.sample_max_new_tokens={self.max_new} exceeds the model's "
                f"max_position_embeddings ({limit})"
            )

    @classmethod
    def build(cls, cfg, pc, model, grads=None) -> SampleMaker | None:
        if not cfg.logging.sample_prompts:
            return None
        from nanotron_train.data import DataError, load_tokenizer

        tk = cfg.tokenizer
        try:
            tok = load_tokenizer(tk.tokenizer_name_or_path, tk.tokenizer_revision)
        except DataError as exc:
            raise ValueError(f"logging.sample_prompts: {exc}") from None
        return cls(cfg, pc, model, tok, grads)

    def _decoding_layout(self, decoding: bool) -> None:
        """Switch every chunk to the decoding layout (ALL_REDUCE, no context parallel: each cp
        rank decodes whole sequences, identically) or back to the training one."""
        par, pc = self.cfg.parallelism, self.pc
        for chunk in stage_chunks(self.model):
            if decoding:
                chunk.set_tp_mode("ALL_REDUCE", False, pc.tensor_collectives, False)
            else:
                chunk.set_tp_mode(
                    par.tp_mode,
                    par.tp_linear_async_communication,
                    pc.tensor_collectives,
                    par.tp_recompute_allgather,
                )
            if pc.cp_size > 1:
                group, size = (None, 1) if decoding else (pc.cp_group, pc.cp_size)
                chunk.set_context_parallel(group, size, pc.tensor_collectives)

    def make(self, step: int, logger) -> list[dict] | None:
        """Called on every rank. Decode on the ranks of dp rank 0's ep group (dp rank 0 alone
        without expert parallelism; collective over their tp, pp and ep groups); rank 0 logs
        and sends the samples. Returns them on rank 0. Under ZeRO-3 every rank first takes
        part in gathering the parameters (over dp)."""
        full = self.grads.full_parameters() if self.grads is not None else nullcontext()
        with full:
            if self.pc.edp_rank != 0:  # dp rank // ep: the first ep group decodes
                return None
            return self._make(step, logger)

    def _make(self, step: int, logger) -> list[dict] | None:
        model, eos = self.model, self.eos
        devices = [self.pc.device] if self.pc.device.type == "cuda" else []
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            self._decoding_layout(True)
            try:
                res = generate(model, self.ids, self.max_new, eos_token_id=eos, pad_token_id=eos)
            finally:
                self._decoding_layout(False)
        if self.pc.rank != 0:
            return None
        samples = []
        for prompt, new in zip(self.prompts, res.tokens):
            text_ids = new[:-1] if new and new[-1] == eos else new
            text = self.tok.decode(text_ids).replace("\x00", "")  # the dashboard refuses NUL
            samples.append({"prompt": prompt.replace("\x00", ""), "completion": text})
        samples = fit_samples(samples)
        took = time.perf_counter() - t0
        print(f"samples at step {step} ({took:.2f} s, greedy):", file=sys.stderr, flush=True)
        for s in samples:
            print(f"  {s['prompt']!r} -> {s['completion']!r}", file=sys.stderr, flush=True)
        if logger is not None:
            logger.samples(
                {
                    "step": step,
                    "time": time.time(),
                    "max_new_tokens": self.max_new,
                    "samples": samples,
                }
            )
        return samples
