"""Qwen3-Next (configs/tiny-qwen3-next-cpu.yaml: Gated DeltaNet and gated-attention layers,
experts with a gated shared expert and one dense MLP, document masking on the packed synthetic
documents, a delta-rule chunk that does not divide the sequence) trains the same model in
every layout as in one process (lm_loss and grad_norm each step, 1e-5): tp=2 x pp=2 sequence
parallel, dp=2 x pp=2 ZeRO-1, dp=2 x tp=2 ZeRO-3 with recompute and the experts over ep=2,
cp=2 x tp=2 and cp=4 (the Gated DeltaNet conv halo and state maps passed across cp ranks, cp
chunks of 8 and 4 tokens against a delta-rule chunk of 12); one process's checkpoint resumes at tp=2 x pp=2
with the same next step; greedy generation at tp=2 x pp=2 equals one process's."""

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
    data["optimizer"]["zero_stage"] = layout.get("zero", 0)
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
        ref = _train([{"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE", "save": ckpt}])[0]
        one_process_tokens = _generate(1, 1)
    layouts = [
        {"dp": 1, "tp": 2, "pp": 2, "mode": "REDUCE_SCATTER"},
        {"dp": 2, "tp": 1, "pp": 2, "mode": "ALL_REDUCE", "zero": 1},
        {"dp": 2, "tp": 2, "pp": 1, "mode": "ALL_REDUCE", "ep": 2, "zero": 3, "recompute": True},
        {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "mode": "ALL_REDUCE"},
        {"dp": 1, "tp": 1, "pp": 1, "cp": 4, "mode": "ALL_REDUCE"},
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
    for layout, res in zip(layouts, results, strict=True):
        for key in ("loss", "norm"):
            for a, b in zip(res[key], ref[key], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (layout, key, res[key], ref[key])
