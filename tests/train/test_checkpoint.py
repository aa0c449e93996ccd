"""Checkpoints: exact resume per layout, resume under other layouts, and the listing CLI.

A tiny Llama (hidden 32, 2 layers, vocab 128, seq 16, global batch 4) trains 12 steps; runs of
one world size share one launch (a fresh ParallelContext per job). Exact resume: a run that
stops at 6 (final save) and resumes to 12 logs the same lm_loss and grad_norm bitwise as one
that never stopped. Reshard: checkpoints resumed under other (dp, tp, pp, zero) or another pipeline
engine (zbv <-> 1f1b, 4 layers) continue the uninterrupted run's curve within 1e-5 relative.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group

STEPS, HALF, REL = 12, 6, 1e-5


def tiny_config(layout: dict, ckpt: str, steps: int = STEPS, resume: str | None = None) -> dict:
    """Global batch 4 sequences whatever dp is; the LR schedule does not depend on steps."""
    dp = layout["dp"]
    return {
        "general": {"project": "test", "run": "ckpt", "seed": 5},
        "parallelism": {
            "dp": dp, "tp": layout["tp"], "pp": layout["pp"],
            "pp_engine": layout.get("engine", "1f1b"), "tp_mode": "ALL_REDUCE",
        },
        "model": {
            "model_config": {
                "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": layout.get("layers", 2),
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 127,
                "max_position_embeddings": 32, "tie_word_embeddings": layout.get("tied", True),
            },
            "init_method": {"std": 0.05},
            "dtype": "float32",
        },
        "tokens": {
            "sequence_length": 16, "micro_batch_size": 2,
            "batch_accumulation_per_replica": 2 // dp if dp <= 2 else 1, "train_steps": steps,
        },
        "optimizer": {
            "zero_stage": layout.get("zero", 0), "weight_decay": 0.1, "clip_grad": 1.0,
            "learning_rate_scheduler": {
                "learning_rate": 3.0e-3, "lr_warmup_steps": 2, "lr_decay_style": "cosine",
                "lr_decay_steps": STEPS, "min_decay_lr": 1.0e-3,
            },
        },
        "checkpoints": {
            "checkpoints_path": ckpt, "checkpoint_interval": HALF,
            "resume_checkpoint_path": resume, "save_final_state": True,
        },
        "data_stages": [{"name": "s", "start_training_step": 1, "data": {"dataset": None, "seed": 3}}],
        "logging": {"iteration_step_info_interval": 1},
    }  # fmt: skip


def run_jobs(jobs: list[dict]) -> list[dict]:
    """On every rank: run each job (layout, ckpt dir, steps, resume); rank 0's curves come back."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for job in jobs:
            lay = job["layout"]
            raw = tiny_config(lay, job["ckpt"], job.get("steps", STEPS), job.get("resume"))
            cfg = config_from_dict(raw, "test", world_size=None)
            pc = ParallelContext(dp=lay["dp"], tp=lay["tp"], pp=lay["pp"])
            try:
                records: list[dict] = []
                Trainer(cfg, pc, stream=io.StringIO()).train(on_record=records.append)
            finally:
                dist.barrier()
                pc.destroy()
            out.append(
                {"loss": [r["lm_loss"] for r in records], "norm": [r["grad_norm"] for r in records]}
            )
    return out


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def exact_jobs(layout: dict, root: Path, tag: str) -> list[dict]:
    """Uninterrupted 12 steps; a run stopping at 6; its resume to 12."""
    return [
        {"layout": layout, "ckpt": str(root / f"{tag}-full")},
        {"layout": layout, "ckpt": str(root / f"{tag}-cut"), "steps": HALF},
        {"layout": layout, "ckpt": str(root / f"{tag}-cut"), "resume": "latest"},
    ]


def check_exact(results: list[dict], layout: dict) -> None:
    full, cut, resumed = results
    assert len(cut["loss"]) == HALF and len(resumed["loss"]) == STEPS - HALF, layout
    assert cut["loss"] == full["loss"][:HALF], layout
    assert resumed["loss"] == full["loss"][HALF:], (layout, resumed["loss"], full["loss"][HALF:])
    assert resumed["norm"] == full["norm"][HALF:], layout


L221 = {"dp": 2, "tp": 2, "pp": 1, "zero": 1}
ZBV = {"dp": 1, "tp": 1, "pp": 2, "engine": "zbv", "layers": 4}
WORLD2 = {
    "dp2_zero1": {"dp": 2, "tp": 1, "pp": 1, "zero": 1},
    "tp2": {"dp": 1, "tp": 2, "pp": 1},
    "pp2_1f1b": {"dp": 1, "tp": 1, "pp": 2, "engine": "1f1b"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every training run of this module: world 1 in-process, then world 4, then world 2."""
    root = tmp_path_factory.mktemp("ckpt")
    single = {"dp": 1, "tp": 1, "pp": 1}
    out = {"root": root, "single": run_jobs(exact_jobs(single, root, "single"))}
    out["w4"] = run_distributed(
        run_jobs, 4, [{"layout": L221, "ckpt": str(root / "w4")}], timeout=240
    )[0][0]
    jobs = []
    for tag, lay in WORLD2.items():
        jobs += exact_jobs(lay, root, tag)
    from_221 = str(root / "w4" / str(HALF))
    jobs += [
        {"layout": {"dp": 1, "tp": 1, "pp": 2}, "ckpt": str(root / "r-112"), "resume": from_221},
        {"layout": {"dp": 1, "tp": 2, "pp": 1}, "ckpt": str(root / "r-121"), "resume": from_221},
        {"layout": {"dp": 2, "tp": 1, "pp": 1}, "ckpt": str(root / "r-211"),
         "resume": str(root / "pp2_1f1b-full" / str(HALF))},
    ]  # fmt: skip
    # across engines at pp=2: zbv (the V: both ends on rank 0) -> 1f1b at 6, back to zbv at 9
    jobs += [
        {"layout": ZBV, "ckpt": str(root / "zbv")},
        {"layout": {**ZBV, "engine": "1f1b"}, "ckpt": str(root / "zbv-1f1b"), "steps": 9,
         "resume": str(root / "zbv" / str(HALF))},
        {"layout": ZBV, "ckpt": str(root / "zbv-back"), "resume": str(root / "zbv-1f1b" / "9")},
    ]  # fmt: skip
    out["w2"] = run_distributed(run_jobs, 2, jobs, timeout=400)[0]
    return out


def test_exact_resume_single_process(runs):
    check_exact(runs["single"], {"dp": 1, "tp": 1, "pp": 1})


@pytest.mark.parametrize("index,tag", list(enumerate(WORLD2)))
def test_exact_resume_parallel(runs, index, tag):
    check_exact(runs["w2"][3 * index : 3 * index + 3], WORLD2[tag])


def test_reshard_continues_the_run(runs):
    w4, w2 = runs["w4"], runs["w2"]
    ref_221 = w4["loss"][HALF:]
    r112, r121, r211 = w2[9:12]
    assert rel(r112["loss"], ref_221) <= REL, (r112["loss"], ref_221)
    assert rel(r121["loss"], ref_221) <= REL, (r121["loss"], ref_221)
    assert rel(r112["norm"], w4["norm"][HALF:]) <= REL
    ref_112 = w2[6]  # the uninterrupted pp=2 run that wrote the checkpoint
    assert rel(r211["loss"], ref_112["loss"][HALF:]) <= REL, (r211["loss"], ref_112["loss"])
    assert rel(r211["norm"], ref_112["norm"][HALF:]) <= REL
    # same model and data in every layout: the 2,2,1 run matches the single process too
    assert rel(w4["loss"], runs["single"][0]["loss"]) <= REL


def test_resume_across_pipeline_engines(runs):
    """A zbv checkpoint resumed under 1f1b, and that run's checkpoint resumed under zbv,
    continue the uninterrupted zbv run within 1e-5 (steps 7-9, then 10-12)."""
    zbv, to_1f1b, back = runs["w2"][12:15]
    assert len(to_1f1b["loss"]) == 3 and len(back["loss"]) == STEPS - 9
    assert rel(to_1f1b["loss"], zbv["loss"][HALF:9]) <= REL, (to_1f1b["loss"], zbv["loss"])
    assert rel(to_1f1b["norm"], zbv["norm"][HALF:9]) <= REL
    assert rel(back["loss"], zbv["loss"][9:]) <= REL, (back["loss"], zbv["loss"])
    assert rel(back["norm"], zbv["norm"][9:]) <= REL


def test_checkpoint_files_and_listing(runs, capsys):
    from nanotron_train.checkpoints.cli import main

    root = runs["root"] / "w4"
    assert (root / "latest.txt").read_text().strip() == str(STEPS)
    meta = json.loads((root / "6" / "checkpoint_metadata.json").read_text())
    assert meta["topology"] == {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 1}
    assert meta["step"] == HALF and meta["consumed_samples"] == 4 * HALF
    assert meta["consumed_tokens"] == 4 * 16 * HALF
    paths = sorted(f["path"] for f in meta["files"])
    assert [p for p in paths if p.startswith("model/")] == [
        "model/pp0_tp0.safetensors",
        "model/pp0_tp1.safetensors",
    ]
    assert len([p for p in paths if p.startswith("optimizer/")]) == 4  # ZeRO-1: every dp rank
    assert len([p for p in paths if p.startswith("rng/")]) == 4
    for f in meta["files"]:
        assert (root / "6" / f["path"]).stat().st_size == f["size"]
    assert main(["list", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["step"], e["complete"], e["latest"]) for e in listed] == [
        (6, True, False),
        (12, True, True),
    ]
    assert listed[0]["consumed_tokens"] == 384 and listed[0]["topology"]["dp"] == 2
    assert (
        listed[0]["size"]
        == sum(f["size"] for f in meta["files"])
        + (root / "6" / "checkpoint_metadata.json").stat().st_size
    )
    assert main(["list", str(root)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:3] == ["6", "384", "2,1,2,1,1"] and table[2].endswith(
        "complete (latest)"
    )
    assert main(["list", str(runs["root"] / "nope")]) == 2
    assert "no such checkpoints folder" in capsys.readouterr().err


def test_tied_weight_stored_once(runs):
    """pp=2 tied: the lm_head copy on the last stage is not written again."""
    from safetensors import safe_open

    folder = runs["root"] / "pp2_1f1b-full" / str(HALF)
    with safe_open(str(folder / "model/pp1_tp0.safetensors"), "pt") as f:
        last = set(f.keys())
    with safe_open(str(folder / "model/pp0_tp0.safetensors"), "pt") as f:
        first = set(f.keys())
    assert "embedding.weight" in first and "lm_head.weight" not in last
    assert "final_norm.weight" in last and not first & last


def _bad_copy(runs, tmp_path: Path, name: str) -> Path:
    import shutil

    dst = tmp_path / name / str(HALF)
    shutil.copytree(runs["root"] / "single-full" / str(HALF), dst)
    return dst


def _meta_edit(folder: Path, fn) -> None:
    path = folder / "checkpoint_metadata.json"
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


BAD = {
    "checksum": (lambda d: _flip_byte(d / "model/pp0_tp0.safetensors"), "model/pp0_tp0.safetensors: checksum mismatch"),
    "truncated": (lambda d: _truncate(d / "optimizer/pp0_tp0_dp0.safetensors"), "pp0_tp0_dp0.safetensors: truncated"),
    "missing_file": (lambda d: (d / "rng/rank0.safetensors").unlink(), "rng/rank0.safetensors: missing file"),
    "size": (lambda d: (d / "data_state.json").write_text((d / "data_state.json").read_text() + " "), "data_state.json: size mismatch"),
    "missing_shard": (
        lambda d: _meta_edit(d, lambda m: m.update(files=[f for f in m["files"] if not f["path"].startswith("model/")])),
        "model/pp0_tp0.safetensors: missing shard",
    ),
    "model_config": (
        lambda d: _meta_edit(d, lambda m: m["model_config"].update(hidden_size=48)),
        "model config does not match (hidden_size: checkpoint 48, config 32)",
    ),
    "no_metadata": (lambda d: (d / "checkpoint_metadata.json").unlink(), "not a complete checkpoint"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_fails_clearly(runs, tmp_path, case):
    from nanotron_train.checkpoints import CheckpointError

    damage, message = BAD[case]
    folder = _bad_copy(runs, tmp_path, case)
    damage(folder)
    job = {
        "layout": {"dp": 1, "tp": 1, "pp": 1},
        "ckpt": str(tmp_path / "out"),
        "resume": str(folder),
    }
    with pytest.raises(CheckpointError) as err:
        run_jobs([job])
    assert message in str(err.value), str(err.value)
    assert not (tmp_path / "out").exists()  # nothing was trained or saved


def test_cli_bad_checkpoint_is_one_line(runs, tmp_path, capsys):
    import yaml

    from nanotron_train.__main__ import main

    folder = _bad_copy(runs, tmp_path, "cli")
    _flip_byte(folder / "model/pp0_tp0.safetensors")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config({"dp": 1, "tp": 1, "pp": 1}, str(tmp_path / "out"))))
    assert main(["--config-file", str(cfg), "--resume", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "checksum mismatch" in err[0], err
