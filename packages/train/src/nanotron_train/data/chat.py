"""Chat data for supervised fine-tuning: conversations rendered with a chat template, tokenized
with a mask of the assistant's tokens, and packed several to a sequence.

A conversation is `{"messages": [{"role": ..., "content": ...}, ...]}` (one JSONL line). Its
text is the tokenizer's chat template (`chat_template.jinja` or `tokenizer_config.json`'s
`chat_template` beside it, or one given) rendered as transformers renders it: Jinja2 in a
sandbox, `trim_blocks` / `lstrip_blocks`, `messages`, `bos_token`, `eos_token`,
`add_generation_prompt` and `raise_exception`.

Which tokens are the assistant's is read from the template itself, for any template: the text
of assistant message i is what rendering messages[:i + 1] adds to rendering messages[:i] with
the generation prompt (the header the template writes before an answer). Each such span is
tokenized on its own, so a token never straddles an answer's boundary; everything else is
context. The loss is taken on a label exactly when the token it predicts is an answer token
(an answer's end marker included, as the template writes it).

Packing: each conversation gives its inputs (its tokens but the last), labels (its tokens but
the first) and label mask; conversations are placed whole, in order, into rows of
`sequence_length` tokens (a new row when the next one does not fit; one longer than a row is
cut), positions restarting at 0 at each, so the model's document masking keeps them apart. The
rest of a row is padding: its own document, no label.

Without document masking in the model (`per_row`), each conversation gets a row of its own,
padded, as Nanotron's SFT data: packed ones would attend to each other. The trainer reads this
through data/sft.py (Nanotron's `sft_dataloader: true`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nanotron_train.data.documents import DOCUMENT_IDS_KEY, document_ids
from nanotron_train.data.errors import DataError

Messages = list[dict[str, str]]


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.50 saves a template


def chat_template_of(tokenizer_file: str) -> str | None:
    """The chat template beside `tokenizer_file`, as transformers reads it: chat_template.jinja
    when present, else tokenizer_config.json's `chat_template` (a string, or the one named
    "default" of a list of {name, template}); None when there is none."""
    folder = Path(tokenizer_file).parent
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text()).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise DataError(f"chat template: {exc}") from None


@dataclass
class ChatFormat:
    """A compiled chat template and the tokenizer it renders for (a LoadedTokenizer)."""

    template: str
    tokenizer: Any
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        self._compiled = _compile(self.template)
        if not self.eos_token:
            self.eos_token = self.tokenizer.tokenizer.id_to_token(self.tokenizer.eos_token_id)

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise DataError(f"chat template: {exc}") from None

    def spans(self, messages: Messages) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, is the assistant's) spans, in order."""
        _check_messages(messages)
        out: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            is_answer = message["role"] == "assistant"
            before = self.render(messages[:i], add_generation_prompt=True) if is_answer else done
            if is_answer and before.startswith(done):
                out.append((before[len(done) :], False))  # the answer's header
            elif is_answer:
                raise DataError("chat template: the generation prompt changes the text before it")
            text = self.render(messages[: i + 1])
            if not text.startswith(before):
                raise DataError("chat template: a message changes the text rendered before it")
            out.append((text[len(before) :], is_answer))
            done = text
        return [(t, a) for t, a in out if t]

    def prompt_ids(self, messages: Messages) -> list[int]:
        """Token ids asking for the next answer: the conversation and the generation prompt,
        tokenized span by span as in training (tokenizing the whole text at once can merge
        across a span's edge, which the model never saw)."""
        ids = self.tokenize(messages)[0] if messages else []
        done = self.render(messages) if messages else ""
        header = self.render(messages, add_generation_prompt=True)[len(done) :]
        return ids + self.tokenizer.encode(header)

    def tokenize(self, messages: Messages) -> tuple[list[int], list[bool]]:
        """Token ids of the conversation and whether each is the assistant's."""
        ids: list[int] = []
        mask: list[bool] = []
        for text, is_answer in self.spans(messages):
            piece = self.tokenizer.encode(text)
            ids += piece
            mask += [is_answer] * len(piece)
        return ids, mask


def read_conversations(path: str, limit: int | None = None) -> list[Messages]:
    """The conversations of a JSONL file, one `{"messages": [...]}` a line (the first `limit`)."""
    out: list[Messages] = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if limit is not None and len(out) >= limit:
                    break
                try:
                    messages = json.loads(line).get("messages")
                    _check_messages(messages)
                except (ValueError, AttributeError, DataError) as exc:
                    why = exc if isinstance(exc, DataError) else "not a JSON object"
                    raise DataError(f"{path}:{number}: {why}") from None
                out.append(messages)
    except OSError as exc:
        raise DataError(f"{path}: {exc.strerror}") from None
    return out


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError('a conversation needs "messages": a non-empty list')
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise DataError(f'every message needs a "role" and a "content": got {m!r}')
        if not isinstance(m.get("content"), str):
            raise DataError(f'every message needs a "role" and a "content": got {m!r}')


def pack(
    conversations: list[tuple[list[int], list[bool]]],
    sequence_length: int,
    pad_token_id: int,
    per_row: bool = False,
) -> dict[str, np.ndarray]:
    """Rows of `sequence_length` holding whole conversations (one each with `per_row`):
    input_ids, label_ids, label_mask, position_ids and document ids, each [rows,
    sequence_length] (see the module's docstring)."""
    S = sequence_length
    rows: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for ids, mask in conversations:
        if len(ids) < 2:
            continue  # nothing to predict
        ids_a = np.asarray(ids[: S + 1], dtype=np.int64)
        mask_a = np.asarray(mask[: S + 1], dtype=bool)
        n = len(ids_a) - 1
        if (per_row or used + n > S) and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append((ids_a[:-1], ids_a[1:], mask_a[1:]))
        used += n
    if not rows[-1]:
        rows.pop()
    out = {k: np.zeros((len(rows), S), dtype=np.int64) for k in ("input_ids", "label_ids")}
    out["input_ids"][:] = pad_token_id
    out["label_mask"] = np.zeros((len(rows), S), dtype=bool)
    out["position_ids"] = np.zeros((len(rows), S), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for inputs, labels, mask in row:
            n = len(inputs)
            out["input_ids"][r, at : at + n] = inputs
            out["label_ids"][r, at : at + n] = labels
            out["label_mask"][r, at : at + n] = mask
            out["position_ids"][r, at : at + n] = np.arange(n)
            at += n
        # padding: positions from 0 again (a document of its own), no label
        out["position_ids"][r, at:] = np.arange(S - at)
    out[DOCUMENT_IDS_KEY] = document_ids(out["position_ids"])
    return out
