"""The Mamba-2 hybrid (configs/tiny-hybrid-cpu.yaml with an `E` layer added: pattern M*-ME,
Nemotron-H's experts with a grouped sigmoid router; document masking on the packed synthetic
documents, a chunk size that does not divide the sequence) trains the same model in every
layout as in one process (lm_loss and grad_norm each step, 1e-5): tp=2 x pp=2
sequence-parallel with the pattern split over the stages, dp=2 x tp=2 x ep=2 ZeRO-3 with
recompute (the experts split over ep), dp=2 x tp=2 ZeRO-1 with Muon (against one process's
Muon run: in_proj orthogonalised section by section from tp shards), dp=2 x pp=2 ZeRO-1 (zbv, the zero-bubble V), cp=2 x tp=2
and cp=4 (the Mamba-2 state and conv halo passed across cp ranks, chunks of 8 and 4 tokens
against a scan chunk of 12); one process's checkpoint resumes at
tp=2 x pp=2 with the same next step; greedy generation at tp=2 x pp=2 equals one process's; its command-line run's loss falls; its step has no host
sync."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from nanotron_parallel.testing import run_distributed, shared_default_group
from nanotron_train.config import config_from_dict

ROOT = Path(__file__).parents[2]
HYBRID = ROOT / "configs" / "tiny-hybrid-cpu.yaml"
STEPS = 3


def hybrid_config(layout: dict) -> dict:
    data = yaml.safe_load(HYBRID.read_text())
    data["model"]["model_config"].update(chunk_size=12, hidden_size=32, num_heads=4, n_groups=2,
                                         state_size=8, intermediate_size=64)  # fmt: skip
    data["model"]["model_config"].update(
        hybrid_override_pattern="M*-ME", num_hidden_layers=5, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        n_group=2, topk_group=1, routed_scaling_factor=1.5,
    )  # fmt: skip
    data["tokens"].update(sequence_length=32, micro_batch_size=2, train_steps=STEPS,
                          batch_accumulation_per_replica=2 // layout["dp"])  # fmt: skip
    data["checkpoints"]["checkpoints_path"] = None
    data["logging"]["metrics_file"] = None
    par = data["parallelism"]
    par.update(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], tp_mode=layout["mode"])
    par.update(
        pp_engine=layout.get("engine", "1f1b"), recompute_layer=layout.get("recompute", False)
    )
    par["context_parallel_size"] = layout.get("cp", 1)
    par["expert_parallel_size"] = layout.get("ep", 1)
    data["optimizer"]["zero_stage"] = layout.get("zero", 0)
    if layout.get("muon"):  # Muon for the hidden 2-D weights (in_proj section by section)
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
        cfg = config_from_dict(hybrid_config(copy.deepcopy(layout)), "h", world_size=None)
        pc = ParallelContext(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"],
                             cp=layout.get("cp", 1), ep=layout.get("ep", 1))  # fmt: skip
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
    """Greedy tokens of a random hybrid (no documents) built at tp x pp: pipelined decoding
    carries each stage's Mamba-2 states and KV cache."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.inference.decoding import generate
    from nanotron_train.model_factory import build_family_stage

    cfg = config_from_dict(hybrid_config({"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE"}), "h")
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


def test_hybrid_layouts_equal_one_process(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with shared_default_group():
        ref, muon_ref = _train([{"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE", "save": ckpt},
                                {"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE", "muon": True}])  # fmt: skip
        one_process_tokens = _generate(1, 1)
    resumed = {"dp": 1, "tp": 2, "pp": 2, "mode": "ALL_REDUCE", "resume": f"{ckpt}/2"}
    layouts = [
        {"dp": 1, "tp": 2, "pp": 2, "mode": "REDUCE_SCATTER"},
        {"dp": 2, "tp": 2, "pp": 1, "ep": 2, "mode": "ALL_REDUCE", "zero": 3, "recompute": True},
        {"dp": 2, "tp": 1, "pp": 2, "mode": "ALL_REDUCE", "zero": 1, "engine": "zbv"},
        {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "mode": "ALL_REDUCE"},
        {"dp": 1, "tp": 1, "pp": 1, "cp": 4, "mode": "ALL_REDUCE"},
        {"dp": 2, "tp": 2, "pp": 1, "mode": "ALL_REDUCE", "zero": 1, "muon": True},
    ]
    (*results, after), tokens = run_distributed(
        _train_and_generate, 4, [*layouts, resumed], timeout=300
    )[0]
    assert tokens == one_process_tokens  # greedy decoding at tp=2 x pp=2
    # one process's checkpoint at step 2 resumed at tp=2 x pp=2: its step 3 is the same
    assert abs(after["loss"][0] - ref["loss"][2]) <= 1e-5 * ref["loss"][2], (after, ref)
    assert abs(after["norm"][0] - ref["norm"][2]) <= 1e-5 * ref["norm"][2], (after, ref)
    assert (
        len(after["loss"]) == 1
        and len(ref["loss"]) == STEPS
        and all(math.isfinite(x) for x in ref["loss"])
    )
    assert muon_ref["loss"][1:] != ref["loss"][1:]  # Muon's steps are not AdamW's
    for layout, res in zip(layouts, results, strict=True):
        want = muon_ref if layout.get("muon") else ref
        for key in ("loss", "norm"):
            for a, b in zip(res[key], want[key], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (layout, key, res[key], want[key])


def test_hybrid_config_trains_from_the_command_line(tmp_path):
    """`python -m nanotron_train --config-file configs/tiny-hybrid-cpu.yaml` (the docs'
    command, fewer steps): the loss of the last step is below the first's."""
    overrides = ["tokens.train_steps=8", "checkpoints.checkpoints_path=null",
                 "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]  # fmt: skip
    cmd = [sys.executable, "-m", "nanotron_train", "--config-file", str(HYBRID)]
    cmd += [a for o in overrides for a in ("--override", o)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one process on a shared machine
    subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True, timeout=300, env=env)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["lm_loss"] < records[0]["lm_loss"] - 0.05


def test_hybrid_step_has_no_host_sync():
    """Document resets, the chunked scan, the masked attention and the experts add no host
    read to a training step (the reset mask is made on the device from the document ids); the
    only reads are torch's CPU grouped matmul's offsets (on the device under CUDA) and the
    optimizer's step counters, both on the host."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer
    from tests.train.test_moe_train import _host_reads

    torch.set_num_threads(1)
    raw = hybrid_config({"dp": 1, "tp": 1, "pp": 1, "mode": "ALL_REDUCE"})
    raw["logging"]["iteration_step_info_interval"] = 1000  # a logged step reads its loss
    cfg = config_from_dict(raw, "h", world_size=None)
    pc = ParallelContext(1, 1, 1)
    try:
        trainer = Trainer(cfg, pc, stream=io.StringIO())
        trainer.train_step()
        reads = _host_reads(trainer.train_step)
        trainer.close()
    finally:
        pc.destroy()
    assert (reads["sync"], reads["split_sizes"]) == (0, 0), reads
    assert reads["grouped_mm"] > 0  # the E layer ran its grouped matmuls
