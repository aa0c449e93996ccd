"""Edited or crafted checkpoints are refused in one line naming the file and the key, and a
resume never writes over a newer checkpoint.

One single-process run of the tiny Llama (4 steps, a checkpoint every 2) is shared: each test
copies its checkpoints, damages a copy and resumes through the command line (`main`), which
must exit 2 with one line and leave the good checkpoints as they were. RNG states are stored
without pickle; a format-1 checkpoint (pickled rng/rank0.pt) still resumes bitwise.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_train.__main__ import main
from tests.train.test_checkpoint import tiny_config

SINGLE = {"dp": 1, "tp": 1, "pp": 1}


def write_config(tmp: Path, ckpt: Path, name: str, steps: int = 4) -> Path:
    raw = tiny_config(SINGLE, str(ckpt), steps=steps)
    raw["checkpoints"]["checkpoint_interval"] = 2
    raw["logging"]["metrics_file"] = str(tmp / f"{name}.jsonl")
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def losses(path: Path) -> list[float]:
    return [json.loads(line)["lm_loss"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Checkpoints 2 and 4 of a 4-step run, and its metrics file (full.jsonl)."""
    tmp = tmp_path_factory.mktemp("meta")
    assert main(["--config-file", str(write_config(tmp, tmp / "ckpt", "full"))]) == 0
    return tmp


def copy_root(run: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(run / "ckpt", root)
    return root


def edit_meta(folder: Path, **changes) -> None:
    path = folder / "checkpoint_metadata.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def replace_file(folder: Path, rel: str, data: bytes, new_rel: str | None = None) -> None:
    """Write `data` as `new_rel` (default `rel`) with its size and checksum updated."""
    (folder / rel).unlink()
    target = new_rel or rel
    (folder / target).write_bytes(data)
    path = folder / "checkpoint_metadata.json"
    meta = json.loads(path.read_text())
    rec = {"path": target, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta["files"] = [r for r in meta["files"] if r["path"] != rel] + [rec]
    path.write_text(json.dumps(meta))


def resume(capsys, tmp_path: Path, folder: Path, ckpt: Path, name: str = "r") -> tuple[int, list]:
    cfg = write_config(tmp_path, ckpt, name)
    code = main(["--config-file", str(cfg), "--resume", str(folder)])
    return code, capsys.readouterr().err.strip().splitlines()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


EDITS = {
    "negative_step": ({"step": -5}, "step: must be an integer >= 0, got -5"),
    "text_step": ({"step": "abc"}, "step: must be an integer >= 0, got 'abc'"),
    "step_not_folder": ({"step": 3}, "step: 3 differs from the folder's name 2"),
    "version": ({"format_version": 7}, "format_version 7, this code reads 1 or 2"),
    "samples": ({"consumed_samples": 9}, "data_state.json: consumed_samples: 8 differs"),
    "tokens": ({"consumed_tokens": 3}, "consumed_tokens: 3 is fewer than consumed_samples 8"),
    "topology": ({"topology": {"dp": 0, "tp": 1, "pp": 1}}, "topology.dp: must be an integer >= 1"),
    "path": ({"files": [{"path": "../x", "size": 1, "sha256": ""}]}, "files.0.path: '../x'"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_edited_metadata_is_refused(run, tmp_path, capsys, case):
    root = copy_root(run, tmp_path)
    edit_meta(root / "2", **EDITS[case][0])
    before = snapshot(root)
    code, err = resume(capsys, tmp_path, root / "2", tmp_path / "out")
    assert code == 2 and len(err) == 1, err
    assert str(root / "2") in err[0] and EDITS[case][1] in err[0], err[0]
    assert snapshot(root) == before and not (tmp_path / "out").exists()


def test_resume_never_overwrites_a_newer_checkpoint(run, tmp_path, capsys):
    root = copy_root(run, tmp_path)
    before = snapshot(root)
    code, err = resume(capsys, tmp_path, root / "2", root)
    assert code == 2 and len(err) == 1, err
    assert f"{root}: holds the checkpoint of step 4, newer than {root / '2'} (step 2)" in err[0]
    assert snapshot(root) == before  # 2 and 4 untouched, nothing added
    # Into another folder the same resume runs, and continues the run bitwise.
    code, err = resume(capsys, tmp_path, root / "2", tmp_path / "other", "other")
    assert code == 0, err
    assert losses(tmp_path / "other.jsonl") == losses(run / "full.jsonl")[2:]
    assert snapshot(root) == before


def test_rng_state_is_not_pickled(run):
    from safetensors.torch import load_file

    folder = run / "ckpt" / "2"
    assert sorted(p.name for p in (folder / "rng").iterdir()) == ["rank0.safetensors"]
    tensors = load_file(str(folder / "rng" / "rank0.safetensors"))
    assert tensors["python"].shape == (625,) and tensors["numpy"].shape == (624,)
    assert tensors["torch"].dtype == torch.uint8
    assert json.loads((folder / "checkpoint_metadata.json").read_text())["format_version"] == 2


CRAFTED = {
    "garbage": lambda t: b"\x00" * 64,
    "shape": lambda t: _safetensors({**t, "python": t["python"][:10]}),
    "words": lambda t: _safetensors({**t, "numpy": t["numpy"] - 2**40}),
}


def _safetensors(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"nanotron": json.dumps({"python_version": 3})})


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_rng_state_is_one_line(run, tmp_path, capsys, case):
    from safetensors.torch import load_file

    root = copy_root(run, tmp_path)
    rel = "rng/rank0.safetensors"
    tensors = load_file(str(root / "2" / rel))
    replace_file(root / "2", rel, CRAFTED[case](tensors))
    code, err = resume(capsys, tmp_path, root / "2", tmp_path / "out")
    assert code == 2 and len(err) == 1, err
    assert f"{root / '2' / rel}: " in err[0], err[0]
    assert not (tmp_path / "out").exists()


def _as_format_1(folder: Path) -> None:
    """Rewrite a checkpoint's RNG state as format 1 had it: a torch.save pickle."""
    from safetensors import safe_open

    rel = "rng/rank0.safetensors"
    with safe_open(str(folder / rel), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        meta = json.loads(f.metadata()["nanotron"])
    state = {
        "python": (meta["python_version"], tuple(t["python"].tolist()), meta["python_gauss_next"]),
        "numpy": [meta["numpy_kind"], t["numpy"].tolist(), meta["numpy_pos"],
                  meta["numpy_has_gauss"], meta["numpy_cached_gaussian"]],
        "torch": t["torch"],
    }  # fmt: skip
    buf = io.BytesIO()
    torch.save(state, buf)
    replace_file(folder, rel, buf.getvalue(), "rng/rank0.pt")
    edit_meta(folder, format_version=1)


class _Payload:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/nanotron-pickle-ran"),))


def test_format_1_checkpoint_still_resumes_bitwise(run, tmp_path, capsys):
    root = copy_root(run, tmp_path)
    _as_format_1(root / "2")
    code, err = resume(capsys, tmp_path, root / "2", tmp_path / "old", "old")
    assert code == 0, err
    assert losses(tmp_path / "old.jsonl") == losses(run / "full.jsonl")[2:]
    # A crafted pickle: refused by weights_only in one line, its code never runs.
    Path("/tmp/nanotron-pickle-ran").unlink(missing_ok=True)
    replace_file(root / "2", "rng/rank0.pt", pickle.dumps({"python": _Payload()}))
    code, err = resume(capsys, tmp_path, root / "2", tmp_path / "bad", "bad")
    assert code == 2 and len(err) == 1, err
    assert f"{root / '2' / 'rng/rank0.pt'}: not a readable RNG state" in err[0], err[0]
    assert not Path("/tmp/nanotron-pickle-ran").exists()


def test_a_family_architecture_change_is_refused_but_a_llama_checkpoint_resumes_as_qwen2() -> None:
    """Qwen2's own architecture keys (window, NoPE layers, biases, interpolation) are compared on
    resume; a Llama checkpoint, which sets none of them, matches a Qwen2 config that adds none."""
    from nanotron_models import LlamaConfig
    from nanotron_models.qwen2 import Qwen2Config
    from nanotron_train.checkpoints.errors import CheckpointError
    from nanotron_train.checkpoints.load import check_model_config

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    saved = {"model_config": Qwen2Config(**sizes, sliding_window_size=8, no_rope_layer=4).to_dict()}
    check_model_config(
        Path("c"), saved, Qwen2Config(**sizes, sliding_window_size=8, no_rope_layer=4)
    )
    with pytest.raises(CheckpointError) as err:
        check_model_config(
            Path("c"), saved, Qwen2Config(**sizes, sliding_window_size=16, no_rope_layer=4)
        )
    assert "sliding_window_size: checkpoint 8, config 16" in str(err.value)
    with pytest.raises(CheckpointError, match="no_rope_layer: checkpoint 4, config None"):
        check_model_config(Path("c"), saved, Qwen2Config(**sizes, sliding_window_size=8))
    check_model_config(
        Path("c"), {"model_config": LlamaConfig(**sizes).to_dict()}, Qwen2Config(**sizes)
    )
