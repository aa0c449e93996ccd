"""Qwen3-Next (configs/tiny-qwen3-next-cpu.yaml: Gated DeltaNet and gated-attention layers,
experts with a gated shared expert and one dense MLP, document masking on the packed synthetic
documents, a delta-rule chunk that does not divide the sequence) trains the same model in
every layout as in one process (lm_loss and grad_norm each step, 1e-5): tp=2 x pp=2 sequence
parallel (1f1b), every other pipeline engine (dp=2 x pp=2 ZeRO-1 afab, tp=2 x pp=2 sequence
parallel zb-h1, dp=2 x pp=2 ZeRO-1 zbv, tp=2 x pp=2 interleaved-1f1b with 2 chunks a rank),
dp=2 x tp=2 ZeRO-3 with recompute and the experts over ep=2, cp=2 x tp=2 and cp=4 (the Gated
DeltaNet conv halo and state maps passed across cp ranks, cp chunks of 8 and 4 tokens against
a delta-rule chunk of 12), dp=2 x tp=2 ZeRO-1 with Muon (against one process's Muon run); one
process's checkpoint resumes at tp=2 x pp=2 with the same next step; greedy generation at
tp=2 x pp=2 equals one process's. Muon orthogonalises each logical matrix of the head-major
fused projections apart."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
from pathlib import Path

import torch
import yaml

from nanotron_parallel.testing import run_distributed, shared_default_group
from nanotron_train.config import config_from_dict

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "configs" / "tiny-qwen3-next-cpu.yaml"
STEPS = 3


def qwen3_next_config(layout: dict) -> dict:
    data = yaml.safe_load(CONFIG.read_text())
    data["model"]["model_config"].update(hidden_size=32, intermediate_size=64, head_dim=8,
                                         linear_key_head_dim=8, linear_value_head_dim=8,
                                         linear_chunk_size=12)  # fmt: skip
    data["tokens"].update(sequence_length=32, micro_batch_size=2, train_steps=STEPS,
                          batch_accumulation_per_replica=2 // layout["dp"])  # fmt: skip
    data["checkpoints"]["checkpoints_path"] = None
    data["logging"]["metrics_file"] = None
    par = data["parallelism"]
    par.update(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], tp_mode=layout["mode"])
    par["expert_parallel_size"] = layout.get("ep", 1)
    par["context_parallel_size"] = layout.get("cp", 1)
    par["recompute_layer"] = layout.get("recompute", False)
    par.update(pp_engine=layout.get("engine", "1f1b"), pp_virtual_stages=layout.get("v", 1))
    data["optimizer"]["zero_stage"] = layout.get("zero", 0)
    if layout.get("muon"):  # Muon for the hidden 2-D weights (fused ones section by section)
        data["optimizer"]["optimizer_factory"]["name"] = "muon"
    if "save" in layout:  # a checkpoint at step 2
        data["checkpoints"].update(checkpoints_path=layout["save"], checkpoint_interval=2)
    if "resume" in layout:
        data["checkpoints"]["resume_checkpoint_path"] = layout["resume"]
    return data


def _train(layouts: list[dict]) -> list[dict]:
    """Each layout's lm_loss and grad_norm curves (inside the caller's shared default group)."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    for layout in layouts:
        cfg = config_from_dict(qwen3_next_config(copy.deepcopy(layout)), "q", world_size=None)
        pc = ParallelContext(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"],
                             ep=layout.get("ep", 1), cp=layout.get("cp", 1))  # fmt: skip
        try:
            records: list[dict] = []
            Trainer(cfg, pc, stream=io.StringIO()).train(on_record=records.append)
        finally:
            dist.barrier()
            pc.destroy()
        out.append({"loss": [r["lm_loss"] for r in records],
                    "norm": [r["grad_norm"] for r in records]})  # fmt: skip
    return out


PROMPTS = [[5, 9, 11, 3, 17], [7, 21]]


def _generate(tp: int, pp: int) -> list[list[int]]:
    """Greedy tokens of a random model (no documents) built at tp x pp: pipelined decoding
    carries each stage's Gated DeltaNet states and KV cache."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.inference.decoding import generate
    from nanotron_train.model_factory import build_family_stage

    raw = qwen3_next_config({"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE"})
    cfg = config_from_dict(raw, "q")
    mc = dataclasses.replace(cfg.model.model_config, _use_doc_masking=False)
    pc = ParallelContext(tp=tp, pp=pp)
    try:
        stage = build_family_stage(mc, pc, 32, pc.pp_rank, pp, seed=3, init_std=0.3)
        return generate(stage, PROMPTS, max_new_tokens=5).tokens
    finally:
        pc.destroy()


def _train_and_generate(layouts: list[dict]) -> tuple[list[dict], list[list[int]]]:
    """One world-4 launch: every layout's curves, then tp=2 x pp=2 decoding."""
    with shared_default_group():
        return _train(layouts), _generate(2, 2)


def test_qwen3_next_layouts_equal_one_process(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with shared_default_group():
        ref, muon_ref = _train([{"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE", "save": ckpt},
                                {"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE", "muon": True}])  # fmt: skip
        one_process_tokens = _generate(1, 1)
    layouts = [
        {"dp": 1, "tp": 2, "pp": 2, "mode": "REDUCE_SCATTER"},
        {"dp": 2, "tp": 1, "pp": 2, "mode": "ALL_REDUCE", "zero": 1, "engine": "afab"},
        {"dp": 1, "tp": 2, "pp": 2, "mode": "REDUCE_SCATTER", "engine": "zb-h1"},
        {"dp": 2, "tp": 1, "pp": 2, "mode": "ALL_REDUCE", "zero": 1, "engine": "zbv"},
        {"dp": 1, "tp": 2, "pp": 2, "mode": "ALL_REDUCE", "engine": "interleaved-1f1b", "v": 2},
        {"dp": 2, "tp": 2, "pp": 1, "mode": "ALL_REDUCE", "ep": 2, "zero": 3, "recompute": True},
        {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "mode": "ALL_REDUCE"},
        {"dp": 1, "tp": 1, "pp": 1, "cp": 4, "mode": "ALL_REDUCE"},
        {"dp": 2, "tp": 2, "pp": 1, "mode": "ALL_REDUCE", "zero": 1, "muon": True},
    ]
    resumed = {"dp": 1, "tp": 2, "pp": 2, "mode": "ALL_REDUCE", "resume": f"{ckpt}/2"}
    (*results, after), tokens = run_distributed(
        _train_and_generate, 4, [*layouts, resumed], timeout=300
    )[0]
    assert tokens == one_process_tokens  # greedy decoding at tp=2 x pp=2
    # one process's checkpoint at step 2 resumed at tp=2 x pp=2: its step 3 is the same
    assert len(after["loss"]) == 1
    assert abs(after["loss"][0] - ref["loss"][2]) <= 1e-5 * ref["loss"][2], (after, ref)
    assert abs(after["norm"][0] - ref["norm"][2]) <= 1e-5 * ref["norm"][2], (after, ref)
    assert len(ref["loss"]) == STEPS and all(math.isfinite(x) for x in ref["loss"])
    assert muon_ref["loss"][1:] != ref["loss"][1:]  # Muon's steps are not AdamW's
    for layout, res in zip(layouts, results, strict=True):
        want = muon_ref if layout.get("muon") else ref
        for key in ("loss", "norm"):
            for a, b in zip(res[key], want[key], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (layout, key, res[key], want[key])


def _rows(heads: int, parts: list[int]) -> list[list[int]]:
    """Row indices of each part of a head-major fused weight, gathered over the heads."""
    width, starts = sum(parts), [sum(parts[:j]) for j in range(len(parts))]
    return [[h * width + s + i for h in range(heads) for i in range(p)]
            for s, p in zip(starts, parts, strict=True)]  # fmt: skip


def test_muon_orthogonalises_each_logical_matrix_of_the_fused_projections():
    """Muon's update of in_proj_qkvz is q, k, v and z each orthogonalised over all key heads
    (HF's rows interleave them key head by key head), of in_proj_ba b and a, of the gated
    attention's qkv the queries, the output gates (interleaved per head), k and v."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.model_factory import build_family_stage
    from nanotron_train.optimizer.matrices import orthogonal_update, stage_matrices
    from nanotron_train.optimizer.muon import MuonSettings
    from nanotron_train.optimizer.newton_schulz import orthogonalise

    cfg = config_from_dict(
        qwen3_next_config({"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE"}), "q"
    )
    mc = cfg.model.model_config
    pc = ParallelContext(1, 1, 1)
    try:
        stage = build_family_stage(mc, pc, 32, seed=3)
        matrices = {m.name: m for m in stage_matrices(list(stage.named_parameters()))}
    finally:
        pc.destroy()
    nk, dk, d = mc.linear_num_key_heads, mc.linear_key_head_dim, mc.head_dim
    dv = mc.linear_num_value_heads // nk * mc.linear_value_head_dim
    r, kv = mc.linear_num_value_heads // nk, mc.num_key_value_heads * d
    q2 = 2 * mc.num_attention_heads * d
    expected = {
        "decoder.0.mixer.in_proj_qkvz.weight": _rows(nk, [dk, dk, dv, dv]),
        "decoder.0.mixer.in_proj_ba.weight": _rows(nk, [r, r]),
        "decoder.1.mixer.qkv.weight": [
            *_rows(mc.num_attention_heads, [d, d]),
            list(range(q2, q2 + kv)),
            list(range(q2 + kv, q2 + 2 * kv)),
        ],  # fmt: skip
    }
    settings = MuonSettings(1.0, 0.0, 0.9, True, (3.4445, -4.7750, 2.0315), 5, 1e-7, None,
                            torch.float32)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for name, rows in expected.items():
        m = matrices[name]
        assert m.blocks() == [(len(idx), m.param.shape[1]) for idx in rows], name
        grad = torch.randn(m.param.shape, generator=gen)
        want = torch.empty_like(grad)
        for idx in rows:
            want[idx] = orthogonalise(grad[idx], settings.ns_coefficients, 5, 1e-7, torch.float32)
        got = orthogonal_update(m, grad, settings, None)
        assert torch.allclose(got, want, atol=1e-6), (name, (got - want).abs().max())
