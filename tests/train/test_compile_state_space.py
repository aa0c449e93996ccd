"""`model.compile: true` on the families whose layers scan a state: a Mamba-2 hybrid (M*, with
recompute), Qwen3-Next (a Gated DeltaNet and a gated attention layer, dense MLPs) and Nanotron's
Mamba-1 example. Each trains 2 steps compiled with the same lm_loss and grad_norm as eager
(1e-5, the Llama compile test's tolerance); every layer is compiled; the chunked scans
(ssd_scan, gated_delta_rule, selective_scan) run eagerly between the compiled graphs (a graph
break at each, so dynamo does not unroll their chunk loops: the tiny hybrid's compile took
minutes of CPU before)."""

from __future__ import annotations

import io

import torch

from nanotron_parallel.testing import shared_default_group
from nanotron_train.config import config_from_dict
from tests.train.test_equivalence import REL, close
from tests.train.test_mamba2_hybrid_train import hybrid_config
from tests.train.test_nanotron_examples import HERE, _mamba_layout_overrides
from tests.train.test_qwen3_next_train import qwen3_next_config

STEPS = 2
SCANS = {"hybrid": "ssd_scan", "qwen3_next": "gated_delta_rule", "mamba1": "selective_scan"}


def _config(family: str, compile_: bool):
    recompute = family == "hybrid"  # the compiled checkpointed call; the others in place
    if family == "mamba1":
        from nanotron_train.config.load import load_config

        flags = [f"model.compile={str(compile_).lower()}", f"tokens.train_steps={STEPS}"]
        return load_config(HERE / "config_mamba.yaml", _mamba_layout_overrides({}) + flags)
    layout = {"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE", "recompute": recompute}
    make = hybrid_config if family == "hybrid" else qwen3_next_config
    data = make(layout)
    # two layers, a scan and an attention (what compiles whole under recompute): each kind's
    # compile costs seconds of CPU; the MoE compiles as in the other tests' layouts
    mc = data["model"]["model_config"]
    if family == "hybrid":
        mc.update(hybrid_override_pattern="M*", num_hidden_layers=2)
    else:
        mc.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                  mlp_only_layers=[0, 1])  # fmt: skip
    data["parallelism"]["recompute_layer"] = recompute
    data["model"]["compile"] = compile_
    data["tokens"]["train_steps"] = STEPS
    return config_from_dict(data, family, world_size=None)


def _train(family: str, compile_: bool) -> dict:
    from torch._dynamo.utils import counters

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    torch._dynamo.reset()  # each family's graphs and recompile budget start afresh
    counters.clear()
    cfg = _config(family, compile_)
    pc = ParallelContext()
    try:
        trainer = Trainer(cfg, pc, stream=io.StringIO())
        records: list[dict] = []
        trainer.train(on_record=records.append)
        model = trainer.state.model
        compiled = sum(m._compiled_call_impl is not None for m in model.modules())
        compiled += sum(len(getattr(m, "_compiled", {})) for m in model.modules())
        layers = sum(len(m.decoder) for m in model.modules() if hasattr(m, "decoder"))
    finally:
        pc.destroy()
    breaks = [str(reason) for reason in counters["graph_break"]]
    return {"loss": [r["lm_loss"] for r in records], "norm": [r["grad_norm"] for r in records],
            "compiled": compiled, "layers": layers, "breaks": breaks,
            "graphs": counters["stats"]["unique_graphs"]}  # fmt: skip


def test_compiled_state_space_families_train_as_eager(monkeypatch):
    torch.set_num_threads(1)
    # The layers' graphs through AOTAutograd without inductor's C++ kernel builds (minutes of
    # CPU for three families): what is traced, where the scans break the graph and how
    # recompute wraps the compiled layers are the same; inductor's kernels are the Llama
    # compile test's (tests/train/test_equivalence_perf.py).
    compile_ = torch.compile

    def aot_eager(*args, **kwargs):
        return compile_(*args, **{"backend": "aot_eager", **kwargs})

    monkeypatch.setattr(torch, "compile", aot_eager)
    with shared_default_group():
        runs = {f: (_train(f, False), _train(f, True)) for f in SCANS}
    torch._dynamo.reset()
    for family, (eager, compiled) in runs.items():
        assert compiled["compiled"] == compiled["layers"] > 0, (family, compiled)
        assert compiled["graphs"] >= 2, (family, compiled)  # graphs on both sides of the scan
        # the scan is left out of the graphs (torch.compiler.disable: a graph break naming it)
        assert compiled["breaks"], (family, compiled)
        assert any(SCANS[family] in b for b in compiled["breaks"]), (family, compiled["breaks"])
        assert close(compiled["loss"], eager["loss"]) <= REL, (family, compiled, eager)
        assert close(compiled["norm"], eager["norm"]) <= REL, (family, compiled, eager)
