"""A Nanotron checkpoint, in its layout (written here from its serialize format: tp=2, pp=2),
imported with `convert from-nanotron`: the weights exactly, the step, the config; the run
continues here on Nanotron's data and init_method.path starts a fresh one from it. A Mamba
checkpoint, which would be misread, is refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.train.datatrove_writer import documents, write_datatrove


def _pairs(pieces: list[tuple[int, int, int]], width: int | None, dim: int) -> str:
    """Nanotron's local_global_slices_pairs text for row (dim 0) or column (dim 1) pieces."""
    out = []
    for local, glob, n in pieces:
        loc, glo = f"{local},{local + n},None", f"{glob},{glob + n},None"
        other = "None,None,None"
        out.append(f"{loc}|{other}#{glo}|{other}" if dim == 0 else f"{other}|{loc}#{other}|{glo}")
    return ";".join(out)


def write_nanotron_checkpoint(folder: Path, full: dict, config: dict, step: int, samples: int):
    """Nanotron's serialize layout: model/<dotted name as folders>/model_<attr>[_pp-rank-P-of-
    PP_tp-rank-T-of-TP].safetensors with `data` and the slice metadata; tp=2, pp=2."""
    import json

    import torch
    import yaml
    from safetensors.torch import save_file

    from nanotron_train.interop.nanotron_names import to_nanotron

    mc = config["model"]["model_config"]
    tp, pp, h = 2, 2, mc["hidden_size"]
    q, kv, inter = (
        h,
        mc["num_key_value_heads"] * h // mc["num_attention_heads"],
        mc["intermediate_size"],
    )
    layers = mc["num_hidden_layers"]
    for ours, tensor in full.items():
        if ours == "lm_head.weight" and mc["tie_word_embeddings"]:
            continue  # tied: stored once, under the embedding's name
        name = to_nanotron(ours)
        *dirs, attr = name.split(".")
        where = folder / "model" / Path(*dirs)
        where.mkdir(parents=True, exist_ok=True)
        layer = int(dirs[2]) if dirs[1] == "decoder" else (0 if "embedding" in ours else layers - 1)
        pp_rank = layer * pp // layers  # the stage holding it
        if tensor.ndim == 1 and "bias" not in ours:  # norms: replicated
            save_file({"data": tensor.contiguous()}, str(where / f"model_{attr}.safetensors"))
            continue
        chunks = {"qkv": [q, kv, kv], "gate_up": [inter, inter]}
        sections = next((c for k, c in chunks.items() if f".{k}." in ours), [tensor.shape[0]])
        dim = 1 if ours.endswith(("o_proj.weight", "down.weight")) else 0
        for r in range(tp):
            if dim == 1:
                n = tensor.shape[1] // tp
                shard, pieces = tensor[:, r * n : (r + 1) * n], [(0, r * n, n)]
            else:
                parts, pieces, local, glob = [], [], 0, 0
                for size in sections:
                    n = size // tp
                    parts.append(tensor[glob + r * n : glob + (r + 1) * n])
                    pieces.append((local, glob + r * n, n))
                    local, glob = local + n, glob + size
                shard = torch.cat(parts)
            meta = {"version": "1.5", "unsharded_shape": str(tuple(tensor.shape)),
                    "local_global_slices_pairs": _pairs(pieces, None, dim)}  # fmt: skip
            file = f"model_{attr}_pp-rank-{pp_rank}-of-{pp}_tp-rank-{r}-of-{tp}.safetensors"
            save_file({"data": shard.contiguous()}, str(where / file), metadata=meta)
    metas = {"consumed_train_samples": samples, "last_train_step": step,
             "consumed_tokens_total": samples * 256, "last_stage_idx": 0,
             "data_stages": [{"name": "Stable Training Stage", "start_training_step": 1,
                              "consumed_train_samples": samples, "sequence_length": 256,
                              "consumed_tokens_per_dataset_folder": {}}]}  # fmt: skip
    (folder / "checkpoint_metadata.json").write_text(
        json.dumps(
            {"version": "1.5", "tp": tp, "dp": 2, "cp": 1, "metas": metas, "custom_metas": None},
            indent=2,
        )  # fmt: skip
    )
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder.parent / "latest.txt").write_text(f"{step}\n")


def test_from_nanotron_imports_weights_step_and_config(tmp_path):
    import io

    import torch
    import yaml

    from nanotron_models import LlamaConfig, build_llama
    from nanotron_models.model import full_state_dict
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict, load_config
    from nanotron_train.convert import main as convert_main
    from nanotron_train.inference.model_io import full_model_tensors, open_checkpoint
    from nanotron_train.trainer import train

    config = yaml.safe_load(
        (Path(__file__).parent / "nanotron" / "config_tiny_llama.yaml").read_text()
    )
    config["general"].update(step=10, consumed_train_samples=40)
    mc = dict(config["model"]["model_config"])
    pc = ParallelContext()
    try:
        model = build_llama(LlamaConfig(**mc), pc, dtype=torch.bfloat16, seed=123)
        original = full_state_dict(model)
    finally:
        pc.destroy()
    write_nanotron_checkpoint(tmp_path / "nt" / "10", original, config, step=10, samples=40)

    out = tmp_path / "ours"
    assert (
        convert_main(["from-nanotron", "--nanotron-path", str(tmp_path / "nt"), "--out", str(out)])
        == 0
    )
    ckpt = open_checkpoint(out)
    assert ckpt.folder == out / "10" and ckpt.metadata["step"] == 10
    assert ckpt.metadata["consumed_samples"] == 40
    got = full_model_tensors(ckpt)
    assert sorted(got) == sorted(n for n in original if n != "lm_head.weight")  # tied: once
    assert all(torch.equal(got[n], original[n]) for n in got)  # exact, bf16 as saved
    cfg = load_config(out / "10" / "config.yaml", world_size=8)  # Nanotron's layout kept
    assert cfg.model.init_method.std == 0.025 and cfg.parallelism.tp_mode == "REDUCE_SCATTER"
    assert cfg.checkpoints.resume_checkpoint_path == str(out.resolve())

    # The run continues here: the data path and the layout changed, nothing else.
    raw = yaml.safe_load((out / "10" / "config.yaml").read_text())
    raw["parallelism"].update(dp=1, tp=1, pp=1)
    raw["checkpoints"]["checkpoints_path"] = None
    raw["tokens"]["train_steps"] = 11
    folder = write_datatrove(tmp_path / "dt", [documents(7, 400)])
    for stage in raw["data_stages"]:
        stage["data"]["dataset"] = {"dataset_folder": str(folder)}
    records: list[dict] = []
    cfg = config_from_dict(raw)
    train(cfg, ParallelContext(1, 1, 1), stream=io.StringIO(), on_record=records.append)
    assert [r["step"] for r in records] == [11]
    # the LR schedule continues: cosine from 3e-4 to 1e-5 over 13 steps after 2 of warm-up
    expected = 1e-5 + (3e-4 - 1e-5) * 0.5 * (1 + math.cos(math.pi * (11 - 2) / 13))
    assert records[0]["lr"] == pytest.approx(expected)
    # init_method.path (ExistingCheckpointInit): a fresh run from the Nanotron weights, or ours
    from nanotron_train.trainer import Trainer

    for source in (tmp_path / "nt" / "10", out):
        fresh = dict(raw, general={**raw["general"], "step": None, "consumed_train_samples": None})
        fresh["checkpoints"] = {"checkpoints_path": None}
        fresh["model"] = {**raw["model"], "init_method": {"path": str(source)}}
        tr = Trainer(config_from_dict(fresh), ParallelContext(1, 1, 1), stream=io.StringIO())
        params = dict(tr.state.model.named_parameters())
        assert all(torch.equal(params[n], original[n]) for n in got)
        assert tr.train_step().step == 1  # step 0: only the weights come from it
        tr.close()
    with pytest.raises(SystemExit):
        convert_main(["from-nanotron", "--out", str(out)])
    bad = convert_main(["from-nanotron", "--nanotron-path", str(tmp_path), "--out", str(out)])
    assert bad == 2


def test_from_nanotron_refuses_a_mamba_checkpoint_it_would_misread(tmp_path, capsys):
    """Nanotron's Mamba example writes in_proj with x and z interleaved by its tp layout: its
    parameter names map, but reading its files as a Llama's would load a mis-ordered model.
    `convert from-nanotron` (and init_method.path, which reads the same files) refuse it in
    one line before writing anything."""
    import yaml

    from nanotron_train.convert import main as convert_main

    config = yaml.safe_load((Path(__file__).parent / "nanotron" / "config_mamba.yaml").read_text())
    config["general"].update(step=3, consumed_train_samples=12)
    for stage in config["data_stages"]:  # a path changed, as a user moving the run would
        stage["data"]["dataset"]["hf_dataset_or_datasets"] = str(tmp_path / "data")
    folder = tmp_path / "nt" / "3"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    metas = {"last_train_step": 3, "consumed_train_samples": 12}
    (folder / "checkpoint_metadata.json").write_text(json.dumps({"metas": metas}))
    argv = ["from-nanotron", "--nanotron-path", str(folder), "--out", str(tmp_path / "o")]
    assert convert_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(folder) in err and "mamba1" in err
    assert not (tmp_path / "o").exists()
