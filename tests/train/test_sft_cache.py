"""The SFT token cache (data/sft_cache.py): a second run reads the packed rows back instead of
tokenizing (counted: calls of the tokenizing function) and draws identical batches; a change
of chat template, tokenizer, data, sequence length, packing or the code that builds the rows
builds under a new key, the same data elsewhere reuses it; `dataset_overwrite_cache` rebuilds
in the same folder; one rank builds while the others wait, and a builder's failure reaches
them."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from nanotron_parallel.testing import shared_default_group
from tests.train.test_sft_train import DATA, ONE, sft_config


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """A record of every tokenization of SFT examples (data/sft.py's tokenize_examples)."""
    from nanotron_train.data import sft

    calls: list[str] = []
    real = sft.tokenize_examples

    def counting(examples, tokenizer, template, where):
        calls.append(where)
        return real(examples, tokenizer, template, where)

    monkeypatch.setattr(sft, "tokenize_examples", counting)
    return calls


def _folders(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def _run_data(overwrite: bool = False):
    """A run's training and validation SFT data, built as the trainer builds them."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.data.source import build_data, build_validation_data

    raw = sft_config(ONE)
    raw["data_stages"][0]["data"]["dataset"]["dataset_overwrite_cache"] = overwrite
    cfg = config_from_dict(raw, "sft.yaml", world_size=None)
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            data = build_data(cfg, pc)
            val = build_validation_data(cfg, pc, data)
        finally:
            pc.destroy()
    batches = [data.micro_batches(step) for step in (1, 2, 3)]
    return batches, val.rows


def _same_batches(a: list[list[dict]], b: list[list[dict]]) -> None:
    for step_a, step_b in zip(a, b, strict=True):
        for mb_a, mb_b in zip(step_a, step_b, strict=True):
            assert sorted(mb_a) == sorted(mb_b)
            assert all(torch.equal(mb_a[k], mb_b[k]) for k in mb_a)


def test_second_run_reads_the_cache_and_draws_identical_batches(tmp_path, monkeypatch, builds):
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOTRON_DATA_CACHE", str(cache))
    first, val_first = _run_data()
    assert len(builds) == 2  # the training examples and the held-out ones, one key each
    assert len(_folders(cache)) == 2 and all(n.startswith("sft-") for n in _folders(cache))
    second, val_second = _run_data()
    assert len(builds) == 2  # nothing tokenized again
    _same_batches(first, second)
    assert all(np.array_equal(val_first[k], val_second[k]) for k in val_first)
    stamps = [(cache / n / "sft.json").stat().st_mtime_ns for n in _folders(cache)]
    third, _ = _run_data(overwrite=True)  # the training stage's rows built again, in place
    assert len(builds) == 3 and len(_folders(cache)) == 2  # no hidden or old folder left
    assert [(cache / n / "sft.json").stat().st_mtime_ns for n in _folders(cache)] != stamps
    _same_batches(first, third)


def test_a_change_of_template_tokenizer_or_data_builds_again(tmp_path, monkeypatch, builds):
    from nanotron_train.data import sft_cache
    from nanotron_train.data.chat import chat_template_of
    from nanotron_train.data.sft import packed_rows
    from nanotron_train.data.sft_cache import SFTCache
    from nanotron_train.data.stages import DatasetSpec

    cache = SFTCache(str(tmp_path / "cache"))
    data = tmp_path / "chat.jsonl"
    shutil.copyfile(DATA / "chat.jsonl", data)
    tok = tmp_path / "tok"
    shutil.copytree(DATA / "tokenizer", tok)

    def rows(path=data, tokenizer=tok, seq=128, masking=True, **keys):
        spec = DatasetSpec(hf_dataset_or_datasets=str(path), sft_dataloader=True,
                           debug_max_samples=12, **keys)  # fmt: skip
        return packed_rows(spec, "t", seq, str(tokenizer), 320, masking, cache)

    base = rows()
    assert len(builds) == 1
    assert all(np.array_equal(base[k], rows()[k]) for k in base) and len(builds) == 1
    template = chat_template_of(str(tok / "tokenizer.json"))
    other = rows(chat_template=template.replace("<|im_end|>\n", "<|im_end|>\n\n"))
    assert len(builds) == 2 and not np.array_equal(other["input_ids"], base["input_ids"])
    rows(chat_template=template)  # the same text as the tokenizer's: its key
    assert len(builds) == 2
    # the same tokenizer, its file written differently: another sha256, so built again
    spec = json.loads((tok / "tokenizer.json").read_text())
    (tok / "tokenizer.json").write_text(json.dumps(spec, indent=1))
    again = rows()
    assert len(builds) == 3 and all(np.array_equal(base[k], again[k]) for k in base)
    copy = tmp_path / "elsewhere.jsonl"
    shutil.copyfile(data, copy)
    rows(path=copy)  # the same content at another path: the cache's
    assert len(builds) == 3
    lines = data.read_text().splitlines(keepends=True)
    data.write_text(lines[1] + lines[0] + "".join(lines[2:]))
    rows()
    rows(seq=96)
    rows(masking=False)
    assert len(builds) == 6
    monkeypatch.setattr(sft_cache, "builders_sha256", lambda: "edited")  # code that builds rows
    rows()
    assert len(builds) == 7
    assert len(_folders(tmp_path / "cache")) == 7  # the template's, 2 tokenizers', 4 others


def test_one_rank_builds_while_the_others_wait(tmp_path, builds, monkeypatch):
    """The builder rank posts the key and its outcome through the store (data/source.py's
    BuilderBarrier): only it reads the data files; a waiting rank reads the same rows, or
    fails at once with the builder's error."""
    import torch.distributed as dist

    from nanotron_train.data import sft_cache
    from nanotron_train.data.errors import DataError
    from nanotron_train.data.sft import packed_rows
    from nanotron_train.data.sft_cache import SFTCache
    from nanotron_train.data.source import BuilderBarrier
    from nanotron_train.data.stages import DatasetSpec

    hashed: list[str] = []  # the thread (rank) of each hash of a data file, for the key
    real_sha256 = sft_cache.file_sha256
    monkeypatch.setattr(
        sft_cache, "file_sha256",
        lambda f: hashed.append(threading.current_thread().name) or real_sha256(f),
    )  # fmt: skip

    def both_ranks(template: str | None, data: Path = DATA / "chat.jsonl") -> list:
        store = dist.HashStore()
        spec = DatasetSpec(hf_dataset_or_datasets=str(data), sft_dataloader=True,
                           debug_max_samples=8, chat_template=template)  # fmt: skip
        out: list = [None, None]

        def rank(r: int) -> None:
            barrier = BuilderBarrier(r == 0, store)
            cache = SFTCache(str(tmp_path / "cache"), r == 0, barrier, share=barrier.share)
            try:
                out[r] = packed_rows(spec, "t", 128, str(DATA / "tokenizer"), 320, True, cache)
            except DataError as exc:
                out[r] = exc

        threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return out

    builder, waiter = both_ranks(None)
    assert builds == ["t"]  # one rank tokenized
    assert hashed == ["rank0"]  # and one rank read the data file for the key
    assert all(np.array_equal(builder[k], waiter[k]) for k in builder)
    builder, waiter = both_ranks(None, tmp_path / "missing.jsonl")  # the key fails
    assert str(builder) == f"{tmp_path / 'missing.jsonl'}: no such file or folder"
    assert str(waiter) == f"the rank building the data cache failed: {builder}"
    builder, waiter = both_ranks("{{ raise_exception('no system turns') }}")
    assert isinstance(builder, DataError) and isinstance(waiter, DataError)
    assert str(waiter).startswith("the rank building the SFT data cache")
    assert str(waiter).endswith("failed: chat template: no system turns")
