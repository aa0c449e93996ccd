"""The default corpus: the Python standard library's own source, on every machine with Python.

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, skipping test suites
(folders named test/tests/idle_test), installed packages (site-packages, dist-packages),
caches and files that are not UTF-8 — a stable body of ~12 MB of code for CPython 3.11.
``prepare_default_corpus`` trains a byte-level BPE on it and tokenizes it, once: the result
is cached under a folder named after the Python version, the vocab size and the file list.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import sysconfig
import time
from pathlib import Path

from nanotron_train.data.errors import DataError
from nanotron_train.data.nanoset import METADATA_FILE
from nanotron_train.data.tokenize import tokenize_to_nanoset
from nanotron_train.data.tokenizer import TOKENIZER_FILE, train_tokenizer

logger = logging.getLogger("nanotron_train.data")
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
DEFAULT_VOCAB_SIZE = 4096


def stdlib_files(root: str | None = None) -> list[Path]:
    """The corpus files, sorted; files that are not UTF-8 are left out."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(base.rglob("*.py")):
        if SKIP_DIRS.intersection(path.relative_to(base).parts[:-1]):
            continue
        try:
            path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(path)
    return files


def _corpus_key(files: list[Path], vocab_size: int) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f}\0{f.stat().st_size}\n".encode())
    ver = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return f"stdlib-{ver}-v{vocab_size}-{digest.hexdigest()[:12]}"


def prepare_default_corpus(
    cache_dir: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    num_workers: int | None = None,
    progress: bool = True,
    root: str | None = None,
) -> tuple[Path, Path]:
    """Train the tokenizer on the stdlib and tokenize it (cached); returns (tokenizer, nanoset).

    ``root`` replaces the stdlib folder (tests use a small one).
    """
    files = stdlib_files(root)
    if not files:
        raise DataError(f"{root}: no UTF-8 .py files for the default corpus")
    root = Path(cache_dir) / _corpus_key(files, vocab_size)
    tok_dir, nanoset_dir = root / "tokenizer", root / "nanoset"
    if not (tok_dir / TOKENIZER_FILE).is_file():
        t0 = time.perf_counter()
        texts = (f.read_text(encoding="utf-8") for f in files)
        train_tokenizer(texts, vocab_size, tok_dir, length=len(files))
        logger.info(
            "data: trained the tokenizer in %.1f s -> %s", time.perf_counter() - t0, tok_dir
        )
    if not (nanoset_dir / METADATA_FILE).is_file():
        t0 = time.perf_counter()
        tokenize_to_nanoset(
            [str(f) for f in files],
            str(tok_dir),
            nanoset_dir,
            num_workers=num_workers,
            overwrite=True,  # only a leftover without metadata can be there
            progress=progress,
        )
        logger.info("data: tokenized in %.1f s -> %s", time.perf_counter() - t0, nanoset_dir)
    return tok_dir, nanoset_dir
