"""`data_stages[].data.dataset.eod_mask_loss`: the label after each document's end (the first
token of the next document) leaves the loss, in training and in evaluation.

One 1-step run per value from the same step-0 checkpoint: the logged lm_loss is the mean
cross-entropy of that model over exactly the labels the key keeps, recomputed here from its full
logits; the evaluate CLI's `--eod-mask-loss` counts the same labels fewer; and with
`validation.split` the stages must agree (config_checks).
"""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F

from nanotron_train.config import ConfigError, config_from_dict
from nanotron_train.data import Nanoset
from nanotron_train.data.stages import DatasetSpec, StageSpec
from nanotron_train.data.testing import make_id_nanoset
from nanotron_train.data.train_data import TrainData
from nanotron_train.data.validation import ValidationData
from tests.train.test_checkpoint import tiny_config

EOS, SEQ = 0, 16


def run_config(folder: str, ckpt: str, mask: bool) -> dict:
    raw = tiny_config({"dp": 1, "tp": 1, "pp": 1}, ckpt, steps=1)
    raw["model"]["model_config"]["vocab_size"] = 128
    raw["checkpoints"]["save_initial_state"] = True
    raw["data_stages"][0]["data"]["dataset"] = {"dataset_folder": folder, "eod_mask_loss": mask}
    return raw


def first_loss(raw: dict) -> float:
    from nanotron_train.trainer import train

    records: list[dict] = []
    train(config_from_dict(raw, "test"), stream=io.StringIO(), on_record=records.append,
          every_step=True)  # fmt: skip
    return records[0]["lm_loss"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("eod")
    # Short documents: several document ends in every 16-token sample.
    folder = str(make_id_nanoset(root / "data", [5, 7, 9, 6] * 30, low=1, high=128,
                                 vocab_size=128, eos=EOS, seed=1))  # fmt: skip
    losses = {m: first_loss(run_config(folder, str(root / f"ck{m}"), m)) for m in (False, True)}
    return {"root": root, "folder": folder, "losses": losses}


def test_loss_leaves_out_exactly_the_labels_after_a_document_end(runs):
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.inference.model_io import load_model, open_checkpoint

    stage = StageSpec("s", 1, DatasetSpec(runs["folder"]), seed=3)  # the config's stage
    micro_batches = TrainData([stage], sequence_length=SEQ, micro_batch_size=2,
                              batch_accumulation_per_replica=2, dp_rank=0, dp_size=1,
                              tokenizer_path=None, cache_dir="unused",
                              model_vocab_size=128).micro_batches(1)  # fmt: skip
    pc = ParallelContext()
    try:
        model = load_model(open_checkpoint(runs["root"] / "ckFalse" / "0"), pc)
        expected, dropped = {False: 0.0, True: 0.0}, 0
        for mb in micro_batches:
            logits = model.logits(mb["input_ids"])
            per_token = F.cross_entropy(logits.flatten(0, 1), mb["label_ids"].flatten(),
                                        reduction="none").view_as(mb["label_ids"])  # fmt: skip
            keep = mb["input_ids"] != EOS  # the label after EOS opens the next document
            dropped += int((~keep).sum())
            expected[False] += float(per_token.mean()) / len(micro_batches)
            expected[True] += float(per_token[keep].mean()) / len(micro_batches)
    finally:
        pc.destroy()
    assert dropped >= 8  # at least two document ends per sample
    for mask in (False, True):
        assert runs["losses"][mask] == pytest.approx(expected[mask], rel=1e-5), mask
    assert abs(expected[True] - expected[False]) > 1e-3


def test_evaluate_cli_counts_the_same_labels_fewer(runs, capsys):
    from nanotron_train.evaluate import main

    args = ["--ckpt-path", str(runs["root"] / "ckTrue" / "1"), "--dataset-folder",
            runs["folder"], "--limit-batches", "2", "--json"]  # fmt: skip
    reports = []
    for extra in ([], ["--eod-mask-loss"]):
        assert main(args + extra) == 0
        reports.append(json.loads(capsys.readouterr().out))
    plain = ValidationData([Nanoset(runs["folder"])], None, sequence_length=SEQ,
                           micro_batch_size=2, batch_accumulation_per_replica=2, dp_rank=0,
                           dp_size=1, limit_batches=2)  # fmt: skip
    ends = sum(int((mb["input_ids"] == EOS).sum()) for mbs, _ in plain.batches() for mb in mbs)
    assert reports[0]["tokens"] == 2 * 4 * SEQ
    assert reports[1]["tokens"] == reports[0]["tokens"] - ends and ends > 0
    assert reports[1]["val_loss"] != reports[0]["val_loss"]


def test_config_key_checks():
    raw = run_config("some/folder", "ck", True)
    assert config_from_dict(raw, "c.yaml").data_stages[0].data.dataset.eod_mask_loss is True
    assert (
        run_config("f", "ck", False)["data_stages"][0]["data"]["dataset"]["eod_mask_loss"] is False
    )
    default = tiny_config({"dp": 1, "tp": 1, "pp": 1}, "ck")
    default["data_stages"][0]["data"]["dataset"] = {"dataset_folder": "f"}
    assert config_from_dict(default, "c.yaml").data_stages[0].data.dataset.eod_mask_loss is False
    second = {"name": "b", "start_training_step": 2,
              "data": {"dataset": {"dataset_folder": "f", "eod_mask_loss": False}}}  # fmt: skip
    raw["data_stages"].append(second)
    config_from_dict(raw, "c.yaml")  # stages may differ without validation.split
    raw["validation"] = {"split": 0.1}
    with pytest.raises(
        ConfigError, match=r"c.yaml: data_stages: data.dataset.eod_mask_loss differs"
    ):
        config_from_dict(raw, "c.yaml")
    raw["validation"] = {"dataset": {"dataset_folder": "v", "eod_mask_loss": True}}
    assert config_from_dict(raw, "c.yaml").validation.dataset.eod_mask_loss is True
    raw["data_stages"][0]["data"]["dataset"]["eod_mask_loss"] = "yes"
    with pytest.raises(ConfigError, match=r"data_stages.0.data.dataset.eod_mask_loss"):
        config_from_dict(raw, "c.yaml")
