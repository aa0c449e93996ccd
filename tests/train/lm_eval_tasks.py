"""lm-evaluation-harness task YAMLs over local JSONL files (nothing downloaded), for the tests
that run the harness: test_lm_eval_harness.py and test_eval_during_training.py. Each writes its
own data; the task text around it is the same, so it is written once here."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch


def task_yaml(
    task: str, data_file: Path, output_type: str, fields: str, metrics: Iterable[str]
) -> str:
    """A task reading `data_file` as its test split; `fields`: its doc_to_* (and generation)
    lines, each ending in a newline; `metrics`: the metric_list, in order."""
    metric_lines = "".join(f"  - metric: {m}\n" for m in metrics)
    return (
        f"task: {task}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {data_file}\n"
        "test_split: test\n"
        f"output_type: {output_type}\n"
        f"{fields}"
        f"metric_list:\n{metric_lines}"
        "metadata:\n"
        "  version: 1\n"
    )


def mc_yaml(task: str, data: Path) -> str:
    """Multiple choice (loglikelihood requests) over data/mc.jsonl's question, choices, label."""
    fields = 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
    return task_yaml(task, data / "mc.jsonl", "multiple_choice", fields, ["acc", "acc_norm"])


def ppl_yaml(task: str, data: Path, metrics: Iterable[str]) -> str:
    """Perplexity (loglikelihood_rolling requests) over data/ppl.jsonl's texts."""
    fields = 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
    return task_yaml(task, data / "ppl.jsonl", "loglikelihood_rolling", fields, metrics)


def offline_workspace(
    tmp_path_factory: pytest.TempPathFactory, name: str, texts: int, vocab_size: int
) -> tuple[Path, Path]:
    """(a fresh folder, a tokenizer built in it from `texts` tiny texts) for a harness test.
    The harness runs offline (its tasks read local files; nothing is downloaded) and torch on
    one thread."""
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    torch.set_num_threads(1)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[var] = "1"
    root = tmp_path_factory.mktemp(name)
    return root, make_tokenizer(root / "tok", tiny_texts(texts), vocab_size=vocab_size)
