"""Context parallelism in training: every cp layout trains the same model as one process.

The matrix points of issue 17 (cp=2 alone, cp=2 x tp=2, cp=2 x pp=2, cp=2 x dp=2 with ZeRO-1)
on the equivalence matrix's config (test_equivalence.py): lm_loss, grad_norm and val_loss at
every step within 1e-5 relative of the single-process run. Checkpoints: cp does not shard
parameters, so one saved at cp=2 resumes at cp=1 and one saved at cp=1 resumes at cp=2, and
the steps after the resume match the run that never stopped.
"""

from __future__ import annotations

import io

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.test_equivalence import (
    REL,
    STEPS,
    check_matches,
    close,
    layout_config,
    make_val_folder,
    run_layouts,
    with_val,
)

RESUME_AT = 5


def train_with_checkpoints(layout: dict, save_to: str | None, resume: str | None) -> dict:
    """One layout of the matrix config, saving every RESUME_AT steps to `save_to` and/or
    resuming from the checkpoint folder `resume`; rank 0's curves come back."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    raw = layout_config(layout)
    raw["checkpoints"] = {
        "checkpoints_path": save_to,
        "checkpoint_interval": RESUME_AT,
        "resume_checkpoint_path": resume,
    }
    cfg = config_from_dict(raw, "test", world_size=None)
    with shared_default_group():
        pc = ParallelContext(
            dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], cp=layout.get("cp", 1)
        )
        try:
            records: list[dict] = []
            Trainer(cfg, pc, stream=io.StringIO()).train(on_record=records.append)
        finally:
            dist.barrier()
            pc.destroy()
    return {
        "steps": [r["step"] for r in records],
        "loss": [r["lm_loss"] for r in records],
        "norm": [r["grad_norm"] for r in records],
    }


def cp_world2(folder: str, cp1_checkpoint: str, save_to: str) -> dict:
    """World 2: the cp=2 matrix point (with validation), the same run with ZeRO-1 (sharded over
    the 2 cp ranks) saving checkpoints, and cp=2 resumed from a checkpoint saved at cp=1."""
    cp2 = {"dp": 1, "tp": 1, "pp": 1, "cp": 2}
    with shared_default_group():  # one default group for the three runs
        return {
            "matrix": run_layouts(with_val([cp2], folder)),
            "saving": train_with_checkpoints({**cp2, "zero": 1}, save_to, None),
            "resumed": train_with_checkpoints(cp2, None, cp1_checkpoint),
        }


CP_WORLD4 = [
    {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "mode": "REDUCE_SCATTER", "tensor_collectives": True,
     "par": {"tp_linear_async_communication": True}},
    {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "tied": False, "par": {"recompute_layer": True}},
    {"dp": 1, "tp": 1, "pp": 2, "cp": 2, "engine": "afab"},
    {"dp": 1, "tp": 1, "pp": 2, "cp": 2, "engine": "1f1b", "tied": False},
    {"dp": 1, "tp": 1, "pp": 2, "cp": 2, "engine": "interleaved-1f1b",
     "par": {"pp_virtual_stages": 2}},
    {"dp": 2, "tp": 1, "pp": 1, "cp": 2, "zero": 1},
]  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cp")
    return {
        "val": make_val_folder(root / "val"),
        "cp1": str(root / "cp1"),
        "cp2": str(root / "cp2"),
    }


@pytest.fixture(scope="module")
def reference(folders) -> dict:
    """The single-process runs (in this process): tied, with validation and with checkpoints;
    untied, with validation."""
    cp1 = {"dp": 1, "tp": 1, "pp": 1}
    ref = run_layouts(with_val([cp1], folders["val"]))[0]
    saving = train_with_checkpoints(cp1, folders["cp1"], None)
    assert close(saving["loss"], ref["loss"]) == 0.0  # saving changes nothing
    untied = run_layouts(with_val([{**cp1, "tied": False}], folders["val"]))[0]
    return {"tied": ref, "untied": untied}


def test_cp2_matches_one_process_and_resumes_across_cp(folders, reference):
    ref = reference["tied"]
    out = run_distributed(
        cp_world2, 2, folders["val"], f"{folders['cp1']}/{RESUME_AT}", folders["cp2"],
        timeout=300,
    )[0]  # fmt: skip
    check_matches([{"dp": 1, "tp": 1, "pp": 1, "cp": 2}], out["matrix"], reference)
    # ZeRO-1 over the cp ranks and saving checkpoints do not change the cp=2 run.
    assert close(out["saving"]["loss"], out["matrix"][0]["loss"]) <= REL
    # Saved at cp=1, resumed at cp=2: the steps after it equal the uninterrupted cp=1 run.
    resumed = out["resumed"]
    assert resumed["steps"] == list(range(RESUME_AT + 1, STEPS + 1))
    assert close(resumed["loss"], ref["loss"][RESUME_AT:]) <= REL
    assert close(resumed["norm"], ref["norm"][RESUME_AT:]) <= REL
    # The checkpoint records cp (cp=1 where it was not recorded), and the listing shows it.
    from nanotron_train.checkpoints.listing import list_checkpoints, to_table

    saved = {e.step: e.topology for e in list_checkpoints(folders["cp2"])}
    assert saved[RESUME_AT] == {"dp": 1, "tp": 1, "pp": 1, "cp": 2, "zero_stage": 1}
    assert "  1,2,1,1,1  " in to_table(list_checkpoints(folders["cp2"]))
    # Saved at cp=2 (optimizer state in 2 ZeRO shards), resumed at cp=1 (one process): equal
    # to the uninterrupted cp=2 run.
    back = train_with_checkpoints({"dp": 1, "tp": 1, "pp": 1}, None, f"{folders['cp2']}/5")
    assert back["steps"] == list(range(RESUME_AT + 1, STEPS + 1))
    assert close(back["loss"], out["saving"]["loss"][RESUME_AT:]) <= REL
    assert close(back["norm"], out["saving"]["norm"][RESUME_AT:]) <= REL


def test_cp2_composes_with_tp_pp_dp_zero1(folders, reference):
    results = run_distributed(run_layouts, 4, with_val(CP_WORLD4, folders["val"]), timeout=400)
    check_matches(CP_WORLD4, results[0], reference)
