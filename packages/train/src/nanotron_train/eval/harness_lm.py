"""Our model as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`, the base of the
harness's own `HFLM`), so the harness's tasks score a checkpoint of ours in any layout.

The harness turns a task into requests of three kinds, answered here as `HFLM` answers them
(same tokenization of context and continuation, same truncation to the model's length, same
stop-sequence handling), so the scores are the ones the harness gives the same weights
exported to Hugging Face:

- `loglikelihood` (multiple choice): the summed log-probability of each continuation after its
  context and whether greedy decoding would produce it (inference/scoring.py, batched).
- `loglikelihood_rolling` (perplexity): a text cut into windows of the model's length, each
  scored as a continuation (the harness's own `get_rolling_token_windows`), summed.
- `generate_until`: greedy (or seeded sampling) decoding with the KV cache
  (inference/decoding.py), a row stopped once its text holds a stop sequence, cut before it.

Every rank of the model's tp x pp group runs the same harness with the same requests in the
same order (the harness's seeds fix them); the scores are the same on every rank. The harness
sees one process (`rank` 0, `world_size` 1): its data-parallel splitting is not used.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nanotron_train.inference.decoding import generate
from nanotron_train.inference.sampling import SamplingParams
from nanotron_train.inference.scoring import ScoreRequest, score

# generation_kwargs a task may give (after the harness's normalize_gen_kwargs) and we honour.
GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "seed"}


class HarnessError(ValueError):
    """A task asks for something the adapter cannot do; the message names it."""


class NanotronLM(TemplateLM):
    """`model`: a loaded ModelStage (or this rank's stage / chunks) in eval mode; `tokenizer`:
    the checkpoint's LoadedTokenizer; `eot` / `prefix`: the ids HFLM would read from the
    exported tokenizer (EOS, and BOS for an empty context); `stop_id`: where generation stops
    (the exported generation_config's EOS)."""

    backend = "causal"

    def __init__(
        self, model, tokenizer, *, eot: int, prefix: int, stop_id: int, batch_size: int = 16
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise HarnessError(f"--batch-size must be >= 1, got {batch_size}")
        self.model, self.tok = model, tokenizer
        self._eot, self._prefix, self.stop_id = eot, prefix, stop_id
        self.batch_size = batch_size

    # -- what the harness reads ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def max_gen_toks(self) -> int:
        return 256  # HFLM's default when a task gives none

    @property
    def tokenizer_name(self) -> str:
        return self.tok.path

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        return self.tok.encode(string)  # no BOS added: HFLM's default for a causal model

    def tok_decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- log-likelihoods -------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kw
    ) -> list[tuple[float, bool]]:
        """(context, continuation) token pairs, longest first in batches; each cut from the left
        to the model's length plus the one token that is only predicted (as HFLM does)."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        out: list[tuple[float, bool]] = []
        for batch in order.get_batched(n=self.batch_size):
            items = [
                ScoreRequest((ctx + cont)[-(self.max_length + 1) :], len(cont))
                for _, ctx, cont in batch
            ]
            out += score(self.model, items, pad_token_id=self._eot)
            for (key, _, _), answer in zip(batch, out[-len(batch) :]):
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return order.get_original(out)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (text,) in [req.args for req in requests]:
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            mine = [(None, *make_disjoint_window(w)) for w in rolling]
            windows += mine
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows)
        out, at = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[at : at + n])
            at += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # -- generation ----------------------------------------------------------------------------
    def _generation_plan(self, gen_kwargs: dict) -> tuple[list[str], int, SamplingParams]:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        unknown = sorted(set(kwargs) - GEN_KEYS)
        if unknown:
            raise HarnessError(
                f"generation_kwargs {unknown}: not supported by the nanotron model (it honours "
                f"{sorted(GEN_KEYS)})"
            )
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.get("until"), eos=eos_text)
        greedy = not kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) == 0.0
        sampling = SamplingParams(
            0.0 if greedy else float(kwargs["temperature"]),
            int(kwargs.get("top_k") or 0),
            float(kwargs.get("top_p") or 1.0),
            int(kwargs.get("seed") or 0),
        ).validate()
        return until, int(kwargs["max_gen_toks"]), sampling

    def _stops_at(self, until: list[str]):
        """True once a row's text holds a stop sequence (the batch goes on for the others)."""
        stops = [u for u in until if u]

        def stop(row: list[int]) -> bool:
            text = self.tok_decode(row, skip_special_tokens=False)
            return any(u in text for u in stops)

        return stop

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        order = Collator(
            [req.args for req in requests],
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        out: list[str] = []
        for batch in order.get_batched(n=self.batch_size):
            contexts, kwargs = [c for c, _ in batch], batch[0][1]
            until, max_new, sampling = self._generation_plan(kwargs)
            room = self.max_length - max_new
            if room < 1:
                raise HarnessError(
                    f"max_gen_toks {max_new} leaves no room for a context in the model's "
                    f"{self.max_length} positions"
                )
            prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-room:] for c in contexts]
            res = generate(
                self.model,
                prompts,
                max_new,
                sampling,
                eos_token_id=self.stop_id,
                pad_token_id=self.stop_id,
                stop=self._stops_at(until),
            )
            for (context, gen_kwargs), new in zip(batch, res.tokens):
                text = postprocess_generated_text(self.tok_decode(new), until, None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return order.get_original(out)
