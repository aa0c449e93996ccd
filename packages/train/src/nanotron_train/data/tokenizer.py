"""Byte-level BPE tokenizers: training one with HF ``tokenizers`` and loading one locally.

A trained tokenizer folder holds ``tokenizer.json`` plus ``tokenizer_config.json`` and
``special_tokens_map.json``, so ``transformers.AutoTokenizer.from_pretrained(DIR)`` loads it.
``<|endoftext|>`` is both BOS and EOS; tokenization appends it after every document.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nanotron_train.data.errors import DataError

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class LoadedTokenizer:
    """A ``tokenizers.Tokenizer`` with what the data path needs to know about it."""

    tokenizer: Tokenizer
    path: str  # the tokenizer.json file it was read from
    sha256: str
    eos_token_id: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _find_eos(tok: Tokenizer, where: str) -> int:
    for name in (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>"):
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    raise DataError(f"{where}: tokenizer has no EOS token (looked for {EOS_TOKEN!r}, '</s>', ...)")


def _resolve_tokenizer_file(name_or_path: str, revision: str | None = None) -> Path:
    path = Path(name_or_path).expanduser()
    if revision is not None and (path.is_dir() or path.is_file()):
        raise DataError(
            f"tokenizer {name_or_path!r} is a local path: tokenizer.tokenizer_revision "
            f"({revision!r}) applies to hub names only; set it to null"
        )
    if path.is_dir():
        candidate = path / TOKENIZER_FILE
        if not candidate.is_file():
            raise DataError(f"{path}: folder has no {TOKENIZER_FILE}")
        return candidate
    if path.is_file():
        return path
    # Not a local path: maybe a hub name already in the local HF cache (never download).
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, TOKENIZER_FILE, revision=revision)
    except Exception:  # noqa: BLE001 (an invalid repo id, no huggingface_hub: not cached)
        cached = None
    if isinstance(cached, str) and os.path.isfile(cached):
        return Path(cached)
    at = f" at revision {revision!r}" if revision is not None else ""
    raise DataError(
        f"tokenizer {name_or_path!r}: not a local folder or tokenizer.json file, and not in "
        f"the local Hugging Face cache{at}. This machine may be offline: pass a local path "
        "(e.g. one made by `python -m nanotron_train.data train-tokenizer`)"
    )


def tokenizer_file_sha256(name_or_path: str) -> str | None:
    """sha256 of the tokenizer.json that `name_or_path` loads; None when it is not found here."""
    try:
        return file_sha256(_resolve_tokenizer_file(str(name_or_path)))
    except DataError:
        return None


def load_tokenizer(name_or_path: str, revision: str | None = None) -> LoadedTokenizer:
    """Load a tokenizer from a local folder, a tokenizer.json file or the local HF cache
    (`revision`: a branch, tag or commit of the hub name, as cached)."""
    file = _resolve_tokenizer_file(str(name_or_path), revision)
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 (tokenizers raises plain Exception)
        raise DataError(f"{file}: not a valid tokenizer.json ({exc})") from None
    return LoadedTokenizer(tok, str(file.resolve()), file_sha256(file), _find_eos(tok, str(file)))


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, *, length: int | None = None
) -> Path:
    """Train a byte-level BPE on ``texts`` and save it (atomically) as a tokenizer folder."""
    if vocab_size < 257 + 1:
        raise DataError(f"--vocab-size {vocab_size}: must be at least 258 (256 bytes + EOS + 1)")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps the round trip exact: decode(encode(text)) == text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    if tok.get_vocab_size() <= 257:
        raise DataError("tokenizer training saw no text: the input is empty")
    return save_tokenizer_folder(tok, out_dir)


def save_tokenizer_folder(tok: Tokenizer, out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tok.save(str(tmp / TOKENIZER_FILE))
        special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 1_000_000_000,
            "clean_up_tokenization_spaces": False,
            **special,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
