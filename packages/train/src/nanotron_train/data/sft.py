"""`SFTData`: the trainer's data for supervised fine-tuning (Nanotron's `sft_dataloader: true`).

The stage's `hf_dataset_or_datasets` is a JSONL file (or a folder of them), one example a line:
`{"messages": [{"role": ..., "content": ...}, ...]}` (a chat, rendered with the chat template
of data/chat.py: `dataset.chat_template`, else the tokenizer's `tokenizer_config.json`), or
Nanotron's `{"prompt": ..., "completion": ...}` (the text prompt + completion + EOS, as
Nanotron's `process_sft`: no template). The label is kept only where the predicted token is
the assistant's (the completion's, its EOS included).

Examples are tokenized in file order (the first `debug_max_samples`) and packed into rows of
sequence_length (chat.pack: several conversations a row with their document ids when the model
masks documents, else one a row), once: the rows are cached (sft_cache.py) for later runs and
the other ranks. Rows are drawn as TrainData draws samples:
global batch k is draws [(k-1)*G, k*G) of a seeded shuffle (reshuffled each epoch), dp rank r
takes its contiguous slice; the position is the step, so resume is exact.

Each micro-batch carries `labelled_tokens` (its count of labels, on the host): the trainer
weighs the loss by tokens over the whole global batch (data/token_weighting.py).

`SFTValidationData`: held-out examples (`validation.dataset` with `sft_dataloader: true`),
packed the same way, measured by the Evaluator (eval/evaluation.py) as ValidationData is.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from nanotron_train.data.chat import ChatFormat, _check_messages, chat_template_of, pack
from nanotron_train.data.documents import DOCUMENT_IDS_KEY
from nanotron_train.data.errors import DataError
from nanotron_train.data.sampler import ShuffledSamples
from nanotron_train.data.sft_cache import SFTCache, cached_rows, sft_cache_key
from nanotron_train.data.stages import DatasetSpec
from nanotron_train.data.tokenizer import load_tokenizer

logger = logging.getLogger("nanotron_train.data")
LABELLED_TOKENS_KEY = "labelled_tokens"  # a micro-batch's labels to train on (0-d, host)
STATE_VERSION = 1
Example = list[dict[str, str]] | tuple[str, str]  # messages, or (prompt, completion)


def example_files(path: str) -> list[Path]:
    """The JSONL file `path`, or the .jsonl files of the folder `path` in name order."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.jsonl") if f.is_file())
        if not files:
            raise DataError(f"{p}: no .jsonl files in the folder")
        return files
    if not p.is_file():
        raise DataError(f"{p}: no such file or folder")
    return [p]


def read_examples(path: str, limit: int | None = None) -> list[Example]:
    """The examples of `path` (the first `limit`), checked line by line."""
    out: list[Example] = []
    for file in example_files(path):
        try:
            with open(file, encoding="utf-8") as f:
                for number, line in enumerate(f, start=1):
                    if limit is not None and len(out) >= limit:
                        return out
                    if line.strip():
                        out.append(_example(line, f"{file}:{number}"))
        except OSError as exc:
            raise DataError(f"{file}: {exc.strerror}") from None
    return out


def _example(line: str, where: str) -> Example:
    try:
        row = json.loads(line)
    except ValueError:
        row = None
    if not isinstance(row, dict):
        raise DataError(f"{where}: not a JSON object")
    if "messages" in row:
        try:
            _check_messages(row["messages"])
        except DataError as exc:
            raise DataError(f"{where}: {exc}") from None
        return row["messages"]
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return (prompt, completion)
    raise DataError(f'{where}: needs "messages", or "prompt" and "completion" strings')


def tokenize_examples(
    examples: list[Example], tokenizer: Any, template: str | None, where: str
) -> list[tuple[list[int], list[bool]]]:
    """Token ids of each example and whether each is a token to train on."""
    chat = None
    out = []
    for ex in examples:
        if isinstance(ex, tuple):  # Nanotron's prompt + completion + EOS
            prompt, answer = tokenizer.encode(ex[0]), tokenizer.encode(ex[1])
            answer.append(tokenizer.eos_token_id)
            out.append((prompt + answer, [False] * len(prompt) + [True] * len(answer)))
            continue
        if chat is None:
            if template is None:
                raise DataError(
                    f"{where}: conversations need a chat template: set dataset.chat_template or "
                    f"give one in tokenizer_config.json or chat_template.jinja beside "
                    f"{tokenizer.path}"
                )
            chat = ChatFormat(template, tokenizer)
        out.append(chat.tokenize(ex))
    return out


def _build_rows(
    spec: DatasetSpec, where: str, sequence_length: int, tokenizer: Any, template: str | None,
    document_masking: bool,
) -> tuple[dict[str, np.ndarray], int]:  # fmt: skip
    """The examples of `spec` tokenized and packed (chat.pack's arrays), and their number."""
    examples = read_examples(str(spec.hf_dataset_or_datasets), spec.debug_max_samples)
    if not examples:
        raise DataError(f"{where}: no examples")
    tokenized = tokenize_examples(examples, tokenizer, template, where)
    rows = pack(tokenized, sequence_length, tokenizer.eos_token_id, per_row=not document_masking)
    if not document_masking:
        del rows[DOCUMENT_IDS_KEY]  # the model would not read them
    return rows, len(examples)


def packed_rows(
    spec: DatasetSpec,
    where: str,
    sequence_length: int,
    tokenizer_path: str | None,
    model_vocab_size: int,
    document_masking: bool,
    cache: SFTCache | None = None,
) -> dict[str, np.ndarray]:
    """The examples of `spec`, tokenized and packed into rows (chat.pack's arrays): read from
    `cache` (sft_cache.py) when it holds them, else built (and cached)."""
    if not tokenizer_path:
        raise DataError(f"{where}: SFT data needs tokenizer.tokenizer_name_or_path")
    tokenizer = load_tokenizer(tokenizer_path)
    template = spec.chat_template or chat_template_of(tokenizer.path)

    def build() -> tuple[dict[str, np.ndarray], int]:
        return _build_rows(spec, where, sequence_length, tokenizer, template, document_masking)

    if cache is None:
        rows, examples = build()
        top, labelled = int(rows["input_ids"].max(initial=0)), int(rows["label_mask"].sum())
        source = "tokenized"
    else:

        def compute_key() -> str:
            files = example_files(str(spec.hf_dataset_or_datasets))
            return sft_cache_key(files, tokenizer.sha256, template, spec.debug_max_samples,
                                 sequence_length, document_masking)  # fmt: skip

        key = cache.key(compute_key)  # hashed by the builder, shared with the other ranks
        rows, meta, built = cached_rows(cache, key, build)
        # sft.json's figures: no pass over the memory-mapped arrays for them
        examples, top, labelled = meta["examples"], meta["max_token_id"], meta["labelled_tokens"]
        source = f"{'tokenized into' if built else 'read from'} {cache.cache_dir}/sft-{key}"
    if top >= model_vocab_size:
        raise DataError(
            f"{where}: token id {top} is outside the model's vocab_size {model_vocab_size}"
        )
    logger.info(
        "data: %s: %d examples in %d rows of %d tokens, %d labelled (%s)",
        where, examples, len(rows["input_ids"]), sequence_length, labelled, source,
    )  # fmt: skip
    return rows


class SFTData:
    """This dp rank's SFT micro-batches of each step (see the module's docstring)."""

    def __init__(
        self,
        spec: DatasetSpec,
        *,
        name: str,
        seed: int,
        sequence_length: int,
        micro_batch_size: int,
        batch_accumulation_per_replica: int,
        dp_rank: int,
        dp_size: int,
        tokenizer_path: str | None,
        model_vocab_size: int,
        document_masking: bool,
        cache: SFTCache | None = None,
    ) -> None:
        where = f"data stage {name!r}: {spec.hf_dataset_or_datasets}"
        self.rows = packed_rows(
            spec, where, sequence_length, tokenizer_path, model_vocab_size, document_masking, cache
        )
        self.labels_per_row = self.rows["label_mask"].sum(axis=1)
        n = len(self.labels_per_row)
        self.sampler = ShuffledSamples(n, seed, 0, f"stage {name!r}", log=dp_rank == 0)
        self.micro_batch_size, self.accum = micro_batch_size, batch_accumulation_per_replica
        self.dp_rank = dp_rank
        self.global_batch_size = micro_batch_size * batch_accumulation_per_replica * dp_size
        self._step = 0

    def micro_batches(self, step: int) -> list[dict]:
        """This dp rank's micro-batches of the global batch of `step` (1-based)."""
        import torch

        per_rank = self.micro_batch_size * self.accum
        first = (step - 1) * self.global_batch_size + self.dp_rank * per_rank
        ids = self.sampler.sample_ids(first, per_rank)
        self._step = step
        out = []
        for m in range(self.accum):
            rows = ids[m * self.micro_batch_size : (m + 1) * self.micro_batch_size]
            batch = {k: torch.from_numpy(v[rows]) for k, v in self.rows.items()}
            labelled = int(self.labels_per_row[rows].sum())
            batch[LABELLED_TOKENS_KEY] = torch.tensor(labelled, dtype=torch.int64)
            out.append(batch)
        return out

    @property
    def consumed_samples(self) -> int:
        return self._step * self.global_batch_size

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "step": self._step,
            "consumed_samples": self.consumed_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        if "step" not in state:
            raise DataError("data state: not saved by an SFT stage (no 'step')")
        self._step = int(state["step"])


class SFTValidationData:
    """Held-out SFT examples (`validation.dataset` with `sft_dataloader: true`): their packed
    rows in file order, the same at every evaluation. A validation batch is one global batch of
    rows (dp rank r its contiguous slice, cut into micro-batches as in training); the last is
    completed with rows without labels; `tokens.limit_val_batches` = B measures the first B.
    `batches()` is ValidationData's: the Evaluator weighs each micro-batch by its labels."""

    def __init__(self, rows: dict[str, np.ndarray], *, micro_batch_size: int,
                 batch_accumulation_per_replica: int, dp_rank: int, dp_size: int,
                 limit_batches: int = 0) -> None:  # fmt: skip
        self.rows = rows
        self.mbs, self.accum, self.dp_rank = (
            micro_batch_size,
            batch_accumulation_per_replica,
            dp_rank,
        )
        self.global_batch_size = micro_batch_size * batch_accumulation_per_replica * dp_size
        n = len(rows["input_ids"])
        batches = -(-n // self.global_batch_size)
        self.num_batches = batches if limit_batches == 0 else min(batches, limit_batches)

    def batches(self):
        import torch

        n = len(self.rows["input_ids"])
        per_rank = self.mbs * self.accum
        for b in range(self.num_batches):
            first = b * self.global_batch_size + self.dp_rank * per_rank
            micro_batches = []
            for m in range(self.accum):
                ids = np.arange(first + m * self.mbs, first + (m + 1) * self.mbs)
                batch = {k: torch.from_numpy(v[np.minimum(ids, n - 1)].copy())
                         for k, v in self.rows.items()}  # fmt: skip
                batch["label_mask"][torch.from_numpy(ids >= n)] = False  # padding rows
                micro_batches.append(batch)
            yield micro_batches, [float(mb["label_mask"].sum()) for mb in micro_batches]
