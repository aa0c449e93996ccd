"""Small deterministic corpora, tokenizers and Nanosets for tests (ours and the trainer's)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from nanotron_train.data.nanoset import NanosetWriter
from nanotron_train.data.tokenizer import train_tokenizer

_WORDS = [
    *("def", "return", "self", "import", "class", "the", "of", "data", "model", "token"),
    *("loss", "step", "for", "in", "if", "else", "café", "naïve", "東京", "😀", "λ", "→", "≤"),
    *("tab\tand\nnew", "lines ", " two  spaces"),
]


def tiny_texts(num_docs: int = 40, seed: int = 0, words: int = 60) -> list[str]:
    """Documents with ASCII, accents, CJK, emoji, tabs, newlines and repeated spaces."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, words))) for _ in range(num_docs)
    ]


def make_tokenizer(
    out_dir: str | Path, texts: list[str] | None = None, vocab_size: int = 300
) -> Path:
    return train_tokenizer(texts or tiny_texts(), vocab_size, out_dir)


def make_id_nanoset(
    out_dir: str | Path,
    doc_lengths: list[int],
    *,
    low: int = 1,
    high: int = 100,
    eos: int = 0,
    vocab_size: int = 256,
    seed: int = 0,
) -> Path:
    """A Nanoset of random ids in [low, high) (no tokenizer), each document ending in ``eos``."""
    rng = np.random.default_rng(seed)
    writer = NanosetWriter(
        out_dir,
        vocab_size=vocab_size,
        eos_token_id=eos,
        tokenizer_path="synthetic",
        tokenizer_sha256="",
    )
    docs = [np.append(rng.integers(low, high, n - 1), eos) for n in doc_lengths]
    writer.add_documents(np.concatenate(docs), np.asarray(doc_lengths))
    return writer.finish()
