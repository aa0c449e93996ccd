"""`model.parametrization`: µTransfer (`mup`) and CompleteP (`completep`) relative to a base
width and depth. Coordinate checks (each layer's output RMS after a few Adam steps stays within
1.5x across widths 64-512 under mup and completep, and across depths 2-8 under completep,
while sp grows), each parameter's multipliers as values, and the layouts (tp, pp, ZeRO) and a
resume against one process."""

from __future__ import annotations

import io
import math

import pytest
import torch

from bench.mup_coord_check import WIDTHS, layer_rms
from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.test_checkpoint import rel, tiny_config

ONE = {"dp": 1, "tp": 1, "pp": 1}
LR = 1e-3  # the coordinate checks' (bench/mup_coord_check.py: the table at 1e-2 too)


def _init(name: str, **base) -> dict:
    return {"std": 0.02, "parametrization": {"name": name, **base}}


@pytest.fixture(scope="module")
def width_rms() -> dict:
    base = {"base_hidden_size": WIDTHS[0], "base_num_layers": 2}
    with shared_default_group():
        return {
            name: [layer_rms(w, _init(name, **base), 6, LR) for w in WIDTHS]
            for name in ("sp", "mup")  # completep at the base depth is mup
        }


def _spread(rows: list[list[float]]) -> float:
    """The largest max/min ratio of one layer's RMS across the rows (widths or depths)."""
    return max(max(col) / min(col) for col in zip(*rows))


def test_coordinate_check_across_width(width_rms):
    assert _spread(width_rms["mup"]) < 1.5, width_rms["mup"]
    sp = width_rms["sp"]
    assert all(sp[-1][i] / sp[0][i] > 3.0 for i in range(len(sp[0]))), sp  # grows with width


def test_coordinate_check_across_depth():
    base = {"base_hidden_size": 64, "base_num_layers": 2}
    out = {}
    with shared_default_group():
        for name in ("mup", "completep"):  # the last layer's output, depths 2, 4, 8
            out[name] = [[layer_rms(64, _init(name, **base), 6, LR, n)[-1]] for n in (2, 4, 8)]
    assert _spread(out["completep"]) < 1.5, out
    assert _spread(out["mup"]) > _spread(out["completep"]), out  # µP alone drifts with depth


def _trainer(raw: dict, pc):
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    return Trainer(config_from_dict(raw, "test", world_size=None), pc, stream=io.StringIO())


def _config(layout: dict, ckpt=None, steps: int = 6, resume=None, **param) -> dict:
    raw = tiny_config(layout, ckpt, steps=steps, resume=resume)  # hidden 32, 2 layers
    raw["model"]["model_config"]["num_hidden_layers"] = 4
    raw["model"]["parametrization"] = param or {
        "name": "completep", "base_hidden_size": 16, "base_num_layers": 2, "completep_alpha": 0.5
    }  # fmt: skip
    raw["checkpoints"]["checkpoint_interval"] = 3
    raw["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = 6
    return raw


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_each_parameters_multipliers(alpha):
    """Width x2 (32 over 16), depth x2 (4 layers over 2), untied: values of every rule."""
    from nanotron_parallel.context import ParallelContext

    param = {"name": "completep", "base_hidden_size": 16, "base_num_layers": 2,
             "completep_alpha": alpha}  # fmt: skip
    layout = {**ONE, "tied": False}
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            t = _trainer(_config(layout, **param), pc)
            sp = dict(_trainer(_config(layout, name="sp"), pc).named_params)
            pieces = {p.name: p for p in t.state.optimizer.pieces}
            depth = 2.0 ** (alpha - 1)
            for name, p in t.named_params:
                hidden = name.endswith(("qkv.weight", "o_proj.weight", "gate_up.weight",
                                        "down.weight"))  # fmt: skip
                ratio = 1 / math.sqrt(2) if hidden else 1.0  # std / sqrt(width x2)
                torch.testing.assert_close(p, sp[name] * ratio, rtol=1e-6, atol=0)
                want_lr = depth / 2 if hidden else (depth if name.endswith("norm.weight") else 1.0)
                assert pieces[name].lr_scale == pytest.approx(want_lr), name
                want_eps = 0.5 * 2.0**-alpha if hidden else 1.0
                assert pieces[name].eps_scale == pytest.approx(want_eps), name
            model = t.state.model
            assert model.final_norm.output_multiplier == 0.5  # readout: 1 / width x2
            layer = model.block("decoder.0")
            assert layer.residual_multiplier == pytest.approx(2.0**-alpha)
            assert layer.attn.q_multiplier == pytest.approx(1 / math.sqrt(32 // 4))  # 1/d
        finally:
            pc.destroy()


def param_jobs(jobs: list[dict]) -> list[list[float]]:
    """On every rank: train each job (layout, ckpt, steps, resume); rank 0's losses."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for job in jobs:
            lay = job["layout"]
            pc = ParallelContext(dp=lay["dp"], tp=lay["tp"], pp=lay["pp"])
            records: list[dict] = []
            try:
                raw = _config(lay, job.get("ckpt"), job.get("steps", 6), job.get("resume"))
                _trainer(raw, pc).train(on_record=records.append)
            finally:
                dist.barrier()
                pc.destroy()
            out.append([r["lm_loss"] for r in records])
    return out


def test_completep_in_every_layout_and_a_resume(tmp_path):
    ck = str(tmp_path / "one")
    full, cut, resumed = param_jobs(
        [
            {"layout": ONE},
            {"layout": ONE, "ckpt": ck, "steps": 3},
            {"layout": ONE, "ckpt": ck, "resume": "latest"},
        ]
    )
    assert cut == full[:3] and resumed == full[3:]  # bitwise
    layouts = [
        {"dp": 1, "tp": 2, "pp": 1},
        {"dp": 1, "tp": 1, "pp": 2},
        {"dp": 2, "tp": 1, "pp": 1, "zero": 1},
    ]
    got = run_distributed(param_jobs, 2, [{"layout": lay} for lay in layouts], timeout=300)[0]
    for lay, losses in zip(layouts, got, strict=True):
        assert rel(losses, full) < 1e-5, (lay, losses, full)
    assert full[-1] < full[0]


def test_a_checkpoint_keeps_its_multipliers_for_inference_and_refuses_hf_export(tmp_path):
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.convert import to_hf
    from nanotron_train.inference.model_io import load_model, open_checkpoint

    ck = tmp_path / "ck"
    (losses,) = param_jobs([{"layout": ONE, "ckpt": str(ck), "steps": 3}])
    ckpt = open_checkpoint(ck / "3")
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            model = load_model(ckpt, pc)
        finally:
            pc.destroy()
    assert model.final_norm.output_multiplier == 0.5  # width 32 over base 16
    assert model.block("decoder.3").residual_multiplier == pytest.approx(2.0**-0.5)
    with pytest.raises(ValueError, match="model.parametrization.name: completep"):
        to_hf(ck / "3", tmp_path / "hf", tokenizer=False)
