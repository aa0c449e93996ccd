"""Muon (optimizer_factory.name: muon): torch's numbers in one process, the same training under
tp, ZeRO-1/3 and pp, exact resume and reshard, its config refusals.

One process: our Muon equals `torch.optim.Muon` within 1e-6 over 10 steps, with a fused
(q, k, v-like) weight orthogonalised per logical matrix against torch's Muon on the split
matrices. Distributed: a tiny Llama (test_checkpoint's: hidden 32, 2 layers) trained 8 steps
under each layout logs lm_loss and grad_norm within 1e-5 relative of one process; the dp=2
ZeRO-1 run also saves at step 4, and one process resumes from it (momentum resharded) on
the same curve.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_parallel.sharding import ParamMeta, set_param_meta
from nanotron_parallel.testing import run_distributed, shared_default_group
from nanotron_train.config import ConfigError, config_from_dict
from nanotron_train.optim import Piece
from nanotron_train.optimizer.matrices import stage_matrices, takes_muon
from nanotron_train.optimizer.muon import Groups, MuonOnPieces, MuonSettings
from tests.train.test_checkpoint import rel, tiny_config

STEPS, HALF, REL = 8, 4, 1e-5
# float32 Newton-Schulz: in bfloat16 the layouts' float32 rounding differences flip some
# elements' bfloat16 rounding (2^-8 apart), ~2e-5 on the loss after 8 steps (newton_schulz.py).
MUON = {
    "name": "muon",
    "muon_learning_rate": 0.02,
    "muon_weight_decay": 0.05,
    "muon_ns_dtype": "float32",
}


# -- one process against torch.optim.Muon --------------------------------------------------


def _piece(name: str, p: torch.nn.Parameter, grad: torch.Tensor) -> Piece:
    flat = p.detach().view(-1)
    return Piece(name, p, 0, p.numel(), flat, False, True, flat, grad.view(-1))


@pytest.mark.parametrize("nesterov,adjust", [(True, "original"), (False, "match_rms_adamw")])
def test_one_process_equals_torch_muon(nesterov, adjust):
    """Plain matrices (tall, wide) step as torch's Muon; the fused 'qkv' weight (sections
    12, 4, 4 by rows) steps as torch's Muon on q, k and v apart."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (24, 16), "b.weight": (16, 40), "qkv.weight": (20, 16)}
    ours = {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for n, s in shapes.items()}
    set_param_meta(ours["qkv.weight"], ParamMeta((20, 16), 0, (12, 4, 4)))
    ref = [torch.nn.Parameter(ours[n].detach().clone()) for n in ("a.weight", "b.weight")]
    ref += [torch.nn.Parameter(t.clone()) for t in ours["qkv.weight"].detach().split([12, 4, 4])]
    torch_muon = torch.optim.Muon(
        ref, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust
    )
    grads = {n: torch.zeros(s) for n, s in shapes.items()}
    settings = MuonSettings(1.0, 0.1, 0.9, nesterov, (3.4445, -4.7750, 2.0315), 5, 1e-7, adjust)
    named = list(ours.items())
    pieces = [_piece(n, p, grads[n]) for n, p in named]
    muon = MuonOnPieces(pieces, stage_matrices(named), settings, Groups(None, 0, 1, False, None))
    for _ in range(10):
        for n in shapes:
            grads[n].copy_(torch.randn(shapes[n], generator=gen))
        for p, g in zip(
            ref, [grads["a.weight"], grads["b.weight"], *grads["qkv.weight"].split([12, 4, 4])]
        ):
            p.grad = g.clone()
        torch_muon.step()
        muon.step(0.02)
    got = [ours["a.weight"], ours["b.weight"], *ours["qkv.weight"].split([12, 4, 4])]
    diff = max((a - b).abs().max().item() for a, b in zip(got, ref))
    assert diff <= 1e-6, diff
    start = torch.randn(shapes["a.weight"], generator=torch.Generator().manual_seed(0)) * 0.1
    assert (ours["a.weight"].detach() - start).abs().max() > 0.05  # it moved: 10 steps of 0.02


def test_muon_takes_the_hidden_matrices_only():
    w = torch.nn.Parameter(torch.zeros(4, 4))
    assert takes_muon("decoder.0.attn.qkv.weight", w)
    assert takes_muon("chunks.1.decoder.3.mlp.down.weight", w)
    assert not takes_muon("embedding.weight", w)
    assert not takes_muon("lm_head.weight", w)
    assert not takes_muon("decoder.0.input_norm.weight", torch.nn.Parameter(torch.zeros(4)))


# -- config ---------------------------------------------------------------------------------


def _factory_error(**factory) -> str:
    raw = tiny_config({"dp": 1, "tp": 1, "pp": 1}, None)
    raw["checkpoints"]["checkpoints_path"] = None
    raw["optimizer"]["optimizer_factory"] = factory
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "c.yaml", world_size=None)
    return str(err.value)


@pytest.mark.parametrize(
    "factory,key,words",
    [
        ({"name": "adamW", "muon_momentum": 0.9}, "optimizer.optimizer_factory", "muon_momentum apply only with name: muon"),
        ({"name": "muon", "muon_momentum": 1.0}, "muon_momentum", "must be in [0, 1)"),
        ({"name": "muon", "muon_ns_steps": 100}, "muon_ns_steps", "must be in [1, 99]"),
        ({"name": "muon", "muon_ns_coefficients": [1.0, 2.0]}, "muon_ns_coefficients", "must be 3 numbers"),
        ({"name": "muon", "muon_adjust_lr_fn": "other"}, "muon_adjust_lr_fn", "must be one of"),
        ({"name": "muon", "muon_learning_rate": 0.0}, "muon_learning_rate", "must be > 0"),
    ],
)  # fmt: skip
def test_config_refusals_are_one_line(factory, key, words):
    message = _factory_error(**factory)
    assert key in message and words in message and "\n" not in message and "c.yaml" in message


# -- training under every layout --------------------------------------------------------------


def muon_config(layout: dict, ckpt: str | None, steps: int, resume: str | None = None) -> dict:
    raw = tiny_config(layout, ckpt, steps, resume)
    raw["optimizer"]["optimizer_factory"] = dict(MUON)
    raw["checkpoints"]["checkpoint_interval"] = HALF
    raw["checkpoints"]["checkpoints_path"] = ckpt
    raw["checkpoints"]["save_final_state"] = ckpt is not None
    return raw


def run_muon_jobs(jobs: list[dict]) -> list[dict]:
    """On every rank: train each job (layout, ckpt, steps, resume); rank 0's curves back."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for job in jobs:
            lay = job["layout"]
            raw = muon_config(lay, job.get("ckpt"), job.get("steps", STEPS), job.get("resume"))
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


SINGLE = {"dp": 1, "tp": 1, "pp": 1}
WORLD2 = {
    "tp2": {"dp": 1, "tp": 2, "pp": 1},
    "dp2_zero1": {"dp": 2, "tp": 1, "pp": 1, "zero": 1},
    "dp2_zero3": {"dp": 2, "tp": 1, "pp": 1, "zero": 3},
    "pp2": {"dp": 1, "tp": 1, "pp": 2},
}
WORLD4 = {
    "tp2_pp2": {"dp": 1, "tp": 2, "pp": 2},
    "dp2_zero1_tp2": {"dp": 2, "tp": 2, "pp": 1, "zero": 1},  # owners gather over tp
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """World 2 (each layout, then a ZeRO-1 run cut at step 4), world 4, then one process: the
    reference, a run cut at 4 and its resume, and a resume of the ZeRO-1 cut."""
    root = tmp_path_factory.mktemp("muon")
    jobs = [{"layout": lay} for lay in WORLD2.values()]
    jobs.append({"layout": WORLD2["dp2_zero1"], "ckpt": str(root / "z1"), "steps": HALF})
    w2 = run_distributed(run_muon_jobs, 2, jobs, timeout=300)[0]
    w4 = [{"layout": lay} for lay in WORLD4.values()]
    w2 += run_distributed(run_muon_jobs, 4, w4, timeout=300)[0]
    single = run_muon_jobs(
        [
            {"layout": SINGLE, "ckpt": str(root / "full")},
            {"layout": SINGLE, "ckpt": str(root / "cut"), "steps": HALF},
            {"layout": SINGLE, "ckpt": str(root / "cut"), "resume": "latest"},
            {
                "layout": SINGLE,
                "ckpt": str(root / "from_z1"),
                "resume": str(root / "z1" / str(HALF)),
            },
        ]
    )
    return {"root": root, "w2": w2, "single": single}


LAYOUTS = [*WORLD2, *WORLD4]


@pytest.mark.parametrize("index,tag", list(enumerate(LAYOUTS)))
def test_layouts_match_one_process(runs, index, tag):
    ref = runs["single"][0]
    res = runs["w2"][index if index < len(WORLD2) else index + 1]  # the ZeRO-1 cut in between
    assert rel(res["loss"], ref["loss"]) <= REL, (tag, res["loss"], ref["loss"])
    assert rel(res["norm"], ref["norm"]) <= REL, (tag, res["norm"], ref["norm"])


def test_muon_learns(runs):
    loss = runs["single"][0]["loss"]
    assert len(loss) == STEPS and loss[-1] < loss[0] - 0.15, loss


def test_exact_resume(runs):
    full, cut, resumed, _ = runs["single"]
    assert cut["loss"] == full["loss"][:HALF]
    assert resumed["loss"] == full["loss"][HALF:] and resumed["norm"] == full["norm"][HALF:]


def test_resume_from_zero1_reshards_momentum(runs):
    full, resumed = runs["single"][0], runs["single"][3]
    assert len(resumed["loss"]) == STEPS - HALF
    assert rel(resumed["loss"], full["loss"][HALF:]) <= REL, (resumed["loss"], full["loss"])


def test_checkpoint_records_each_group(runs):
    """The optimizer file names both groups' settings and holds one momentum per matrix range."""
    from nanotron_train.checkpoints.safetensors_io import read_header

    folder = Path(runs["root"]) / "cut" / str(HALF)
    entries, meta = read_header(folder / "optimizer" / "pp0_tp0_dp0.safetensors")
    settings = meta["optimizer"]
    assert settings["name"] == "muon"
    assert settings["muon"]["lr"] == pytest.approx(0.02) and settings["muon"]["momentum"] == 0.95
    assert settings["muon"]["weight_decay"] == 0.05 and settings["muon"]["nesterov"] is True
    assert (
        settings["adamW"]["lr"] == pytest.approx(3e-3) and settings["adamW"]["weight_decay"] == 0.1
    )
    muon_names = settings["muon_params"]
    assert len(muon_names) == 2 * 4  # qkv, o_proj, gate_up, down per layer
    momentum = sorted(k for k in entries if k.endswith(":momentum_buffer"))
    assert sorted(k.split(":")[0] for k in momentum) == sorted(muon_names)
    assert not any(k.split(":")[0] in muon_names for k in entries if k.endswith(":exp_avg"))
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    assert saved["optimizer"]["optimizer_factory"]["muon_learning_rate"] == 0.02


def test_resume_with_another_optimizer_is_one_line(runs, tmp_path):
    """AdamW resuming a Muon checkpoint: the matrices have no Adam moments: one line."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.checkpoints.errors import CheckpointError
    from nanotron_train.trainer import Trainer

    resume = str(Path(runs["root"]) / "cut" / str(HALF))
    cfg = config_from_dict(tiny_config(SINGLE, str(tmp_path), STEPS, resume), "t", world_size=None)
    with shared_default_group():
        pc = ParallelContext()
        try:
            with pytest.raises(CheckpointError) as err:
                Trainer(cfg, pc, stream=io.StringIO())
        finally:
            pc.destroy()
    message = str(err.value)
    assert message.endswith(":exp_avg is missing") and "\n" not in message, message
    assert "pp0_tp0_dp0.safetensors" in message
