"""µP with a mixture of experts (a Qwen2-MoE model: 4 experts, top-2, a shared expert, every
layer MoE). Each expert's matrices and the shared expert's are hidden matrices (the dense MLP's
rules, with per-expert fans); the router and the shared expert's gate map the hidden state to a
width-independent size (µP's output layer: std / m, Adam rate / m). Tested as values per
parameter under completep (alpha 0.5, width x2, depth x2) and under Nanotron's spectral
`use_mup`, and by a coordinate check of the MoE branch's output at widths 64 and 256 (mup
holds, sp grows)."""

from __future__ import annotations

import io
import math
import tempfile
from pathlib import Path

import pytest
import torch

from bench.mup_coord_check import layer_rms
from nanotron_parallel.testing import shared_default_group
from tests.train.test_moe_metrics import tiny_moe

H, E, MOE_INTER, SHARED, LAYERS = 32, 4, 16, 32, 2  # tiny_moe's sizes
STD = 0.05
SCALED = STD / math.sqrt(2 * LAYERS)  # scaling_method NUM_LAYERS: the outputs' projections
LR = 3.0e-3
# suffix -> (fan_in, fan_out, output projection?, router?) of each kind of MoE parameter
MOE_PARAMS = {
    "mlp.experts.gate_up_proj": (H, 2 * MOE_INTER, False, False),
    "mlp.experts.down_proj": (MOE_INTER, H, True, False),
    "mlp.shared_expert.gate_up.weight": (H, 2 * SHARED, False, False),
    "mlp.shared_expert.down.weight": (SHARED, H, True, False),
    "mlp.router.weight": (H, E, False, True),
    "mlp.shared_expert_gate.weight": (H, 1, False, True),
}
ATTN = {"attn.qkv.weight": False, "attn.o_proj.weight": True}  # hidden: output projection?


def _raw(init: dict, param: dict | None = None) -> dict:
    raw = tiny_moe(Path(tempfile.gettempdir()))
    raw["logging"].pop("metrics_file")
    raw["model"]["init_method"] = init
    if param is not None:
        raw["model"]["parametrization"] = param
    return raw


def _trainers(*raws: dict) -> list:
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    pc = ParallelContext(1, 1, 1)
    try:
        return [
            Trainer(config_from_dict(r, "test", world_size=None), pc, stream=io.StringIO())
            for r in raws
        ]
    finally:
        pc.destroy()


def _kind(name: str) -> str:
    found = [s for s in (*MOE_PARAMS, *ATTN) if name.endswith(s)]
    return found[0] if found else ""


@pytest.fixture(scope="module")
def built() -> dict:
    with shared_default_group():
        sp, cp, spectral = _trainers(
            _raw({"std": STD}),
            _raw(
                {"std": STD},
                {
                    "name": "completep",
                    "base_hidden_size": 16,
                    "base_num_layers": 1,
                    "completep_alpha": 0.5,
                },
            ),  # fmt: skip
            _raw({"use_mup": True}),
        )
    return {"sp": dict(sp.named_params), "completep": cp, "spectral": spectral}


def test_completep_rules_for_experts_router_and_shared_expert(built):
    """Width x2 (32 over 16), depth x2 (2 layers over 1), alpha 0.5."""
    sp, t = built["sp"], built["completep"]
    depth = 2.0**-0.5  # L^(alpha - 1)
    pieces = {p.name: p for p in t.state.optimizer.pieces}
    kinds = set()
    for name, p in t.named_params:
        kind = _kind(name)
        kinds.add(kind)
        router = kind in MOE_PARAMS and MOE_PARAMS[kind][3]
        hidden = bool(kind) and not router
        ratio = 0.5 if router else (1 / math.sqrt(2) if hidden else 1.0)  # std/m, std/sqrt(m)
        torch.testing.assert_close(p, sp[name] * ratio, rtol=1e-6, atol=0)
        norm = name.endswith("norm.weight")
        want_lr = depth / 2 if kind else (depth if norm else 1.0)
        assert pieces[name].lr_scale == pytest.approx(want_lr), name
        want_eps = 2.0**-0.5 if router else (0.5 * 2.0**-0.5 if hidden else 1.0)
        assert pieces[name].eps_scale == pytest.approx(want_eps), name
    assert set(MOE_PARAMS) <= kinds  # every kind of MoE parameter was checked


def test_use_mup_rules_for_experts_router_and_shared_expert(built):
    """Nanotron's spectral formulas, per expert's fans; the router and gate as linear maps."""
    sp, t = built["sp"], built["spectral"]
    fans = {n: MOE_PARAMS[_kind(n)] for n, _ in t.named_params if _kind(n) in MOE_PARAMS}
    assert len(fans) == len(MOE_PARAMS) * LAYERS
    for name, p in t.named_params:
        if name in fans:
            fan_in, fan_out, out_proj, _ = fans[name]
            std = (1.0 / math.sqrt(fan_in)) * min(1.0, math.sqrt(fan_out / fan_in))
            want = sp[name] * (std / (SCALED if out_proj else STD))  # the same seeded draws
            torch.testing.assert_close(p, want, rtol=1e-6, atol=0)
    t.state.optimizer.step(LR)  # zero gradients: sets each group's learning rate
    lrs = {id(q): g["lr"] for g in t.state.optimizer.inner.param_groups for q in g["params"]}
    got = {pc.name: lrs[id(pc.master)] for pc in t.state.optimizer.pieces}
    for name, (fan_in, fan_out, _, _) in fans.items():
        assert got[name] == pytest.approx(LR * fan_out / fan_in, rel=1e-12), name


def test_coordinate_check_of_a_moe_model_across_width():
    """Each layer's MoE output (its experts, shared expert and routing; the layer's output is
    mostly the residual stream) RMS after 6 Adam steps (lr 1e-3), width 256 over width 64."""
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only spins (6x the CPU time)
    try:
        with shared_default_group():
            for name in ("sp", "mup"):
                init = {"std": 0.02, "parametrization": {"name": name, "base_hidden_size": 64}}
                rms = (layer_rms(w, init, 6, 1e-3, moe=True, part="mlp") for w in (64, 256))
                narrow, wide = rms
                out[name] = [b / a for a, b in zip(narrow, wide, strict=True)]
    finally:
        torch.set_num_threads(threads)
    assert all(1 / 1.5 < r < 1.5 for r in out["mup"]), out
    assert min(out["sp"]) > 3.0, out  # grows with width (7.5x and 8.8x measured)
