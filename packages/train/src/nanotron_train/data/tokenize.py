"""Tokenize local inputs into a Nanoset, with worker processes and a tokens/s progress bar.

The parent reads documents in order and hands batches of them to worker processes
(``imap`` keeps the order, so the output does not depend on the worker count); each worker
encodes its batch and appends EOS to every document. The Nanoset is written to a temporary
folder and renamed at the end (see ``NanosetWriter``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from nanotron_train.data.errors import DataError
from nanotron_train.data.nanoset import NanosetWriter
from nanotron_train.data.readers import describe, expand_inputs, iter_documents, total_bytes
from nanotron_train.data.tokenizer import LoadedTokenizer, load_tokenizer

BATCH_CHARS = 1 << 20  # ~1 MB of text per worker task: big enough to amortise the pickling
BYTES_PER_WORKER = 4 << 20

_worker_tokenizer: LoadedTokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process = one core
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_batch(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode documents; returns (all ids with EOS after each document, document lengths)."""
    tok = _worker_tokenizer
    assert tok is not None
    encodings = tok.tokenizer.encode_batch(texts, add_special_tokens=False)
    docs = [np.asarray([*enc.ids, tok.eos_token_id], dtype=np.int64) for enc in encodings]
    return np.concatenate(docs), np.asarray([len(d) for d in docs], dtype=np.int64)


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def default_num_workers(input_bytes: int) -> int:
    """One worker per ~4 MB of input (a worker costs more than it saves below that), <= 8."""
    return max(1, min(8, os.cpu_count() or 1, input_bytes // BYTES_PER_WORKER))


def _context() -> mp.context.BaseContext:
    # fork: workers start in milliseconds and never re-import the caller's __main__ (spawn
    # would re-run the trainer's entry module in every worker). They only use tokenizers
    # and numpy, with tokenizers' own threads off.
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def tokenize_to_nanoset(
    inputs: list[str] | str,
    tokenizer_path: str,
    out_dir: str | os.PathLike,
    *,
    text_column: str = "text",
    num_workers: int | None = None,
    model_vocab_size: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    splits: list[str] | None = None,
) -> Path:
    """Tokenize ``inputs`` with the tokenizer at ``tokenizer_path`` into a Nanoset at ``out_dir``."""
    sources = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer_path)
    if model_vocab_size is not None and tok.vocab_size > model_vocab_size:
        raise DataError(
            f"{tok.path}: tokenizer vocab size {tok.vocab_size} exceeds the model's "
            f"vocab_size {model_vocab_size}"
        )
    writer = NanosetWriter(
        out_dir,
        vocab_size=tok.vocab_size,
        eos_token_id=tok.eos_token_id,
        tokenizer_path=tok.path,
        tokenizer_sha256=tok.sha256,
        overwrite=overwrite,
    )
    if num_workers is None:
        num_workers = default_num_workers(total_bytes(sources))
    workers = max(1, num_workers)
    pool = None
    try:
        batches = _batches(iter_documents(sources, text_column, splits))
        if workers > 1:
            pool = _context().Pool(workers, _init_worker, (tok.path,))
            results = pool.imap(_encode_batch, batches)
        else:
            _init_worker(tok.path)
            results = map(_encode_batch, batches)
        bar = tqdm(
            desc=f"tokenize -> {Path(out_dir).name}",
            unit="tok",
            unit_scale=True,
            disable=not progress,
        )
        with bar:
            for ids, lengths in results:
                writer.add_documents(ids, lengths)
                bar.update(len(ids))
        if writer.num_tokens == 0:
            raise DataError(f"{describe(sources)}: input holds no text")
        return writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
