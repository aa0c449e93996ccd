"""Context parallelism in training: every cp layout trains the same model as one process.

Each context-parallel attention (all-gather, ring, Ulysses) at cp=2, the ring at cp=4,
and composed with tp=2 (both modes), pp=2 (three engines) and dp=2 with ZeRO-1, on the
equivalence matrix's config (test_equivalence.py): lm_loss, grad_norm (and val_loss for the
matrix points) at every step within 1e-5 relative of the single-process run. Checkpoints: cp does not shard
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
            trainer = Trainer(cfg, pc, stream=io.StringIO())
            trainer.train(on_record=records.append)
            tied_ok = trainer.tied.copies_equal()
        finally:
            dist.barrier()
            pc.destroy()
    return {
        "steps": [r["step"] for r in records],
        "loss": [r["lm_loss"] for r in records],
        "norm": [r["grad_norm"] for r in records],
        "val": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
        "tied_ok": tied_ok,
    }


def cp_world2(folder: str, cp1_checkpoint: str, save_to: str) -> dict:
    """World 2, one run per cp attention: the cp=2 matrix point with the all-gather (with
    validation), the ring with ZeRO-1 (sharded over the 2 cp ranks) saving checkpoints, and
    Ulysses resumed from a checkpoint saved at cp=1."""
    cp2 = {"dp": 1, "tp": 1, "pp": 1, "cp": 2}
    with shared_default_group():  # one default group for the runs
        return {
            "matrix": run_layouts(with_val([cp2], folder)),
            "saving": train_with_checkpoints({**cp2, "zero": 1, **_RING}, save_to, None),
            "resumed": train_with_checkpoints({**cp2, **_ULYSSES}, None, cp1_checkpoint),
        }


_RING = {"par": {"cp_attention": "ring"}}
_ULYSSES = {"par": {"cp_attention": "ulysses"}}


# The ring at cp=4 (Ulysses at cp=4: tests/parallel/test_context_parallel.py), each cp
# attention with tp (both modes) and pp, the all-gather with dp x ZeRO-1.
CP_WORLD4 = [
    {"dp": 1, "tp": 1, "pp": 1, "cp": 4, **_RING},
    {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "mode": "REDUCE_SCATTER", "tensor_collectives": True,
     "par": {"tp_linear_async_communication": True, "cp_attention": "ring"}},
    {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "tied": False,
     "par": {"recompute_layer": True, "cp_attention": "ulysses"}},
    {"dp": 1, "tp": 1, "pp": 2, "cp": 2, "engine": "afab", **_RING},
    {"dp": 1, "tp": 1, "pp": 2, "cp": 2, "engine": "1f1b", "tied": False, **_ULYSSES},
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
    """The single-process runs (in this process): tied, with validation and checkpoints;
    untied, with validation. (Document masks and windows under each cp attention:
    tests/train/test_qwen2_train.py, by value against each document alone.)"""
    cp1 = {"dp": 1, "tp": 1, "pp": 1}
    ref = train_with_checkpoints({**cp1, "val": folders["val"]}, folders["cp1"], None)
    untied = run_layouts(with_val([{**cp1, "tied": False}], folders["val"]))[0]
    return {"tied": ref, "untied": untied}


def test_cp2_matches_one_process_and_resumes_across_cp(folders, reference):
    ref = reference["tied"]
    out = run_distributed(
        cp_world2, 2, folders["val"], f"{folders['cp1']}/{RESUME_AT}", folders["cp2"],
        timeout=300,
    )[0]  # fmt: skip
    check_matches([{"dp": 1, "tp": 1, "pp": 1, "cp": 2}], out["matrix"], reference)
    # The ring, with ZeRO-1 over the cp ranks and saving checkpoints, trains the same model.
    assert close(out["saving"]["loss"], ref["loss"]) <= REL
    assert close(out["saving"]["norm"], ref["norm"]) <= REL
    # Saved at cp=1, resumed at cp=2 (Ulysses): the steps after it equal the uninterrupted
    # cp=1 run.
    resumed = out["resumed"]
    assert resumed["steps"] == list(range(RESUME_AT + 1, STEPS + 1))
    assert close(resumed["loss"], ref["loss"][RESUME_AT:]) <= REL
    assert close(resumed["norm"], ref["norm"][RESUME_AT:]) <= REL
    # The checkpoint records cp (cp=1 where it was not recorded), and the listing shows it.
    from nanotron_train.checkpoints.listing import list_checkpoints, to_table

    saved = {e.step: e.topology for e in list_checkpoints(folders["cp2"])}
    assert saved[RESUME_AT] == {"dp": 1, "tp": 1, "pp": 1, "cp": 2, "ep": 1, "zero_stage": 1}
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


def test_cp_attention_key_is_checked_and_nanotron_ring_maps_to_ring():
    """`parallelism.cp_attention`: an unknown value and Ulysses with heads not divisible by
    cp x tp are one line naming the key; null is the all-gather, or the ring when the model
    config says Nanotron's llama3_ring_attention."""
    from nanotron_train.config import ConfigError, config_from_dict
    from nanotron_train.config.context_parallel import cp_attention
    from tests.train.test_equivalence import layout_config

    def load(cp: int, tp: int, **par):
        raw = layout_config({"dp": 1, "tp": tp, "pp": 1, "cp": cp, "par": par})
        return config_from_dict(raw, "cp.yaml", world_size=None)

    with pytest.raises(ConfigError, match="parallelism.cp_attention") as err:
        load(2, 1, cp_attention="striped")
    assert "\n" not in str(err.value)
    with pytest.raises(
        ConfigError, match="parallelism.cp_attention.*parallel_size \\* tp = 8.*= 4"
    ):
        load(4, 2, cp_attention="ulysses")  # 4 heads over 8 ranks
    assert cp_attention(load(2, 2, cp_attention="ulysses").parallelism, None) == "ulysses"
    cfg = load(2, 1)
    assert cp_attention(cfg.parallelism, cfg.model.model_config) == "allgather"
    cfg.model.model_config._attn_implementation = "llama3_ring_attention"
    assert cp_attention(cfg.parallelism, cfg.model.model_config) == "ring"
