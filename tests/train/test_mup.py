"""Nanotron's spectral µP (`model.init_method.use_mup: true`): each parameter's initial values
and learning rate equal Nanotron's formulas (SpectralMupParametrizator and
LearningRateForSpectralMup, written out again here), tied and untied; the per-parameter
learning rates survive tp, pp and ZeRO (the losses equal one process's) and a resume."""

from __future__ import annotations

import io
import math

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.test_checkpoint import rel, tiny_config

ONE = {"dp": 1, "tp": 1, "pp": 1}
H, INTER, HEADS, KV, VOCAB = 32, 64, 4, 2, 127  # tiny_config's Llama
D = H // HEADS
# name suffix -> (fan_in, fan_out) of the FULL weight, as Nanotron's TensorParallelColumn/Row
# linears compute them (fused q/k/v and gate/up are one linear each there too)
FANS = {
    "attn.qkv.weight": (H, (HEADS + 2 * KV) * D),
    "attn.o_proj.weight": (HEADS * D, H),
    "mlp.gate_up.weight": (H, 2 * INTER),
    "mlp.down.weight": (INTER, H),
    "lm_head.weight": (H, VOCAB),  # untied only: tied, it is the embedding
}
LR = 3.0e-3
MUON = {"name": "muon", "muon_learning_rate": 0.02, "muon_ns_dtype": "float32"}


def _nanotron_rule(name: str, tied: bool) -> tuple[float | None, float]:
    """(init std, lr multiplier); std None: ones (norms)."""
    if name.endswith("norm.weight"):
        return None, 1.0
    if name == "embedding.weight" or (name == "lm_head.weight" and tied):
        return 1.0, 1.0  # SpectralMupParametrizator._parametrize_embedding: std = 1.0
    fan_in, fan_out = next(f for s, f in FANS.items() if name.endswith(s))
    std = (1.0 / math.sqrt(fan_in)) * min(1, math.sqrt(fan_out / fan_in))
    return std, fan_out / fan_in


def _config(layout: dict, ckpt: str | None = None, steps: int = 6, resume=None) -> dict:
    raw = tiny_config(layout, ckpt, steps=steps, resume=resume)
    raw["model"]["init_method"] = {"use_mup": True}
    raw["checkpoints"]["checkpoint_interval"] = 3
    raw["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = 6
    return raw


def _trainer(raw: dict, pc):
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    return Trainer(config_from_dict(raw, "test", world_size=None), pc, stream=io.StringIO())


@pytest.mark.parametrize("tied", [True, False])
def test_use_mup_init_and_learning_rates_are_nanotrons(tied):
    from nanotron_parallel.context import ParallelContext

    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            mup = _trainer(_config({**ONE, "tied": tied}), pc)
            sp_raw = _config({**ONE, "tied": tied})
            sp_raw["model"]["init_method"] = {"std": 0.05}
            sp = dict(_trainer(sp_raw, pc).named_params)
            rows = {}
            for name, p in mup.named_params:
                std, scale = _nanotron_rule(name, tied)
                rows[name] = scale
                if std is None:
                    assert torch.equal(p, torch.ones_like(p)), name
                    continue
                # the same seeded draws as sp (std 0.05, o_proj/down / sqrt(2 layers))
                sp_std = 0.05 / (2.0 if name.endswith(("o_proj.weight", "down.weight")) else 1.0)
                torch.testing.assert_close(p, sp[name] * (std / sp_std), rtol=1e-6, atol=0)
            mup.state.optimizer.step(LR)  # zero gradients: sets each group's learning rate
            lrs = {
                id(g_p): g["lr"]
                for g in mup.state.optimizer.inner.param_groups
                for g_p in g["params"]
            }
            got = {pc_.name: lrs[id(pc_.master)] for pc_ in mup.state.optimizer.pieces}
            assert got == pytest.approx({n: LR * s for n, s in rows.items()}, rel=1e-12)
            assert ("lm_head.weight" in got) == (not tied)
        finally:
            pc.destroy()


def mup_jobs(jobs: list[dict]) -> list[list[float]]:
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
                if job.get("muon"):  # float32 Newton-Schulz: layouts within 1e-5
                    raw["optimizer"]["optimizer_factory"] = dict(MUON)
                _trainer(raw, pc).train(on_record=records.append)
            finally:
                dist.barrier()
                pc.destroy()
            out.append([r["lm_loss"] for r in records])
    return out


def test_mup_learning_rates_survive_every_layout_and_a_resume(tmp_path):
    ck = str(tmp_path / "one")
    full, cut, resumed, muon = mup_jobs(
        [
            {"layout": {**ONE, "tied": False}},
            {"layout": {**ONE, "tied": False}, "ckpt": ck, "steps": 3},
            {"layout": {**ONE, "tied": False}, "ckpt": ck, "resume": "latest"},
            {"layout": {**ONE, "tied": False}, "muon": True},
        ]
    )
    assert cut == full[:3] and resumed == full[3:]  # bitwise
    layouts = [
        {"dp": 1, "tp": 2, "pp": 1, "tied": False},
        {"dp": 1, "tp": 1, "pp": 2, "tied": False},
        {"dp": 2, "tp": 1, "pp": 1, "zero": 1, "tied": False},
        {"dp": 2, "tp": 1, "pp": 1, "zero": 3, "tied": False},
    ]
    jobs = [{"layout": lay} for lay in layouts] + [{"layout": layouts[0], "muon": True}]
    *got, muon_tp2 = run_distributed(mup_jobs, 2, jobs, timeout=300)[0]
    for lay, losses in zip(layouts, got, strict=True):
        assert rel(losses, full) < 1e-5, (lay, losses, full)
    assert full[-1] < full[0] and rel(muon_tp2, muon) < 1e-5 and muon != full


def test_use_mup_with_muon_scales_what_adamw_steps():
    """Muon's hidden matrices keep Muon's rule; the AdamW-stepped lm_head gets fan_out/fan_in."""
    from nanotron_parallel.context import ParallelContext

    raw = _config({**ONE, "tied": False})
    raw["optimizer"]["optimizer_factory"] = dict(MUON)
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            opt = _trainer(raw, pc).state.optimizer
            adamw = {p.name: p.lr_scale for p in opt.adamw.pieces}
            assert adamw["lm_head.weight"] == VOCAB / H and adamw["embedding.weight"] == 1.0
            assert "decoder.0.attn.qkv.weight" not in adamw
            assert opt.settings()["muon"]["lr"] == MUON["muon_learning_rate"]
        finally:
            pc.destroy()


def test_use_mup_on_qwen2_biases_stay_zero_at_the_base_rate():
    """The second family: Qwen2's q/k/v biases (Nanotron has no spectral rule for a bias)."""
    from nanotron_parallel.context import ParallelContext
    from tests.train.test_qwen2_train import masked_config

    raw = masked_config({"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE"})
    raw["model"]["init_method"] = {"use_mup": True}
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            trainer = _trainer(raw, pc)
            mc = trainer.cfg.model.model_config
            d = mc.hidden_size // mc.num_attention_heads
            qkv_out = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * d
            params = dict(trainer.named_params)
            scales = {pc_.name: pc_.lr_scale for pc_ in trainer.state.optimizer.pieces}
            biases = [n for n in params if n.endswith("qkv.bias")]
            assert biases and all(not params[n].any() and scales[n] == 1.0 for n in biases)
            assert scales["decoder.0.attn.qkv.weight"] == qkv_out / mc.hidden_size
            std = (1 / math.sqrt(mc.hidden_size)) * min(1, math.sqrt(qkv_out / mc.hidden_size))
            assert float(params["decoder.0.attn.qkv.weight"].std()) == pytest.approx(std, rel=0.05)
        finally:
            pc.destroy()
