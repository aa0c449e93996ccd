"""Expert parallelism trains the same model as one process: a Qwen2 MoE (Nanotron's
config_qwen_with_moe.yaml at test sizes: 4 experts, top-2, a shared expert) at ep=2 with
either dispatcher and with tp=2 (sequence parallel), pp=2 (zb-h1, recompute), cp=2, ZeRO-1
and ZeRO-3, every step's lm_loss, aux loss and grad_norm within 1e-5 of one process; a router forced to send
every token to one expert drops nothing (same losses); a checkpoint saved at ep=2 resumes
bitwise at ep=2 and within 1e-5 at ep=1; a step's host reads are the dispatchers' split
sizes only, one per MoE layer and micro-batch (test_step_syncs.py's count, made explicit for
expert parallelism). All layouts share one world-4 launch."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_parallel.testing import run_distributed, shared_default_group
from nanotron_train.config import ConfigError, config_from_dict

QWEN_MOE = Path(__file__).parent / "nanotron" / "config_qwen_with_moe.yaml"
STEPS = 3
SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    sliding_window_size=None,
    _attn_implementation="sdpa",
)
MOE = dict(num_experts=4, top_k=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
# Every token's first choice is expert 0 (sigmoid router, a fixed bias on expert 0).
SKEWED = dict(router="sigmoid_bias", router_bias_update_rate=0.0)


def moe_config(layout: dict) -> dict:
    data = yaml.safe_load(QWEN_MOE.read_text())
    mc = data["model"]["model_config"]
    mc.update(SIZES)
    mc["moe_config"].update(MOE, token_dispatcher_type=layout.get("dispatcher", "alltoall"))
    if layout.get("skewed"):
        mc["moe_config"].update(SKEWED)
    data["model"]["dtype"] = "float32"
    data["model"]["compile"] = layout.get("compile", False)
    dp = layout.get("dp", 1)
    data["tokens"].update(sequence_length=32, micro_batch_size=1, train_steps=STEPS)
    data["tokens"]["batch_accumulation_per_replica"] = 4 // dp
    data["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = STEPS
    data["optimizer"]["optimizer_factory"]["torch_adam_is_fused"] = False
    data["optimizer"]["zero_stage"] = layout.get("zero", 0)
    data["data_stages"][0]["data"]["dataset"] = None  # synthetic tokens
    data["checkpoints"].update(checkpoints_path=layout.get("save"), checkpoint_interval=2)
    data["checkpoints"]["resume_checkpoint_path"] = layout.get("resume")
    data["general"]["ignore_sanity_checks"] = False  # dense and expert replicas checked
    data["logging"]["iteration_step_info_interval"] = 1
    par = data["parallelism"]
    par.update(dp=dp, tp=layout.get("tp", 1), pp=layout.get("pp", 1))
    par["pp_engine"] = layout.get("engine", "1f1b")
    par.update(context_parallel_size=layout.get("cp", 1), expert_parallel_size=layout.get("ep", 1))
    par.update(tp_mode=layout.get("mode", "ALL_REDUCE"), tp_linear_async_communication=False)
    par["recompute_layer"] = layout.get("recompute", False)
    return data


def _skew(trainer) -> None:
    """Bias every MoE router's choice towards expert 0 (not a trained value)."""
    from nanotron_models.moe.stats import moe_blocks

    for _, block in moe_blocks(trainer.state.model):
        block.router.expert_bias.fill_(0.0)
        block.router.expert_bias[0] = 10.0


def train_layouts(layouts: list[dict]) -> list[dict]:
    """Each layout's per-step records (the caller holds the default group)."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    out = []
    for layout in layouts:
        cfg = config_from_dict(moe_config(copy.deepcopy(layout)), "moe.yaml", world_size=None)
        par = cfg.parallelism
        pc = ParallelContext(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.context_parallel_size,
                             ep=par.expert_parallel_size)  # fmt: skip
        try:
            records: list[dict] = []
            trainer = Trainer(cfg, pc, stream=io.StringIO())
            if layout.get("skewed"):
                _skew(trainer)
            trainer.train(on_record=records.append)
        finally:
            dist.barrier()
            pc.destroy()
        out.append({r["step"]: _values(r) for r in records})
    return out


def _values(record: dict) -> dict:
    keys = ("lm_loss", "grad_norm", "moe/aux_loss", "moe/load_imbalance", "moe_load")
    return {k: record.get(k) for k in keys}


def _host_reads(fn) -> dict[str, int]:
    """Profiled host reads of `fn()` by where they happen: `sync` (a device sync on a GPU),
    `grouped_mm` (torch's CPU grouped matmul reads its offsets; the CUDA kernel takes them on
    the device), `optimizer` (torch's AdamW step counters, on the host) and the dispatchers'
    named split-size reads (`split_sizes`)."""
    from torch.profiler import ProfilerActivity, profile

    from nanotron_parallel.expert_parallel.functional import HOST_READ
    from tests.train.test_step_syncs import SYNC_OPS

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out = dict.fromkeys(("sync", "grouped_mm", "optimizer", "split_sizes"), 0)
    for e in prof.events():
        if e.name == HOST_READ:
            out["split_sizes"] += 1
        if e.name not in SYNC_OPS or e.name == "aten::_local_scalar_dense":
            continue  # counted once, as aten::item / aten::is_nonzero
        where, parent = "sync", e.cpu_parent
        while parent is not None and where == "sync":
            if parent.name == "aten::_grouped_mm":
                where = "grouped_mm"
            elif parent.name.startswith("Optimizer.step#"):
                where = "optimizer"
            parent = parent.cpu_parent
        out[where] += 1
    return out


def count_syncs(layout: dict) -> dict:
    """A third training step's host reads at an ep layout (the caller holds the default
    group)."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    raw = moe_config(layout)
    raw["logging"]["iteration_step_info_interval"] = 1000  # a logged step reads its loss
    raw["general"]["ignore_sanity_checks"] = True  # the debugging checks read on the host
    cfg = config_from_dict(raw, "moe.yaml", world_size=None)
    pc = ParallelContext(dp=4, ep=2)
    try:
        trainer = Trainer(cfg, pc, stream=io.StringIO())
        trainer.train_step()
        trainer.train_step()
        reads = _host_reads(trainer.train_step)
        trainer.close()
    finally:
        dist.barrier()
        pc.destroy()
    return reads


def launch(layouts: list[dict]) -> dict:
    torch.set_num_threads(1)
    with shared_default_group():
        trained = train_layouts(layouts)
        kinds = ("alltoall", "allgather")
        syncs = {k: count_syncs({"dp": 4, "ep": 2, "dispatcher": k}) for k in kinds}
    return {"trained": trained, "syncs": syncs}


def _close(got: dict, ref: dict, what) -> None:
    assert sorted(got) == sorted(ref), what
    for step, values in got.items():
        for key, b in ref[step].items():
            a = values[key]
            if b is None:
                assert a is None, (what, key)
                continue
            if isinstance(b, dict):  # tokens per expert per layer: counted exactly
                assert a == b, (what, step, key, a, b)
                continue
            assert abs(a - b) <= 1e-5 * abs(b), (what, step, key, a, b)


def test_expert_parallel_layouts_and_resume_equal_one_process(tmp_path) -> None:
    saved = str(tmp_path / "ckpt")
    with shared_default_group():
        ref, skewed = train_layouts([{}, {"skewed": True}])
    assert ref[1]["moe/aux_loss"] is not None and math.isfinite(ref[1]["lm_loss"])
    # tokens per expert of each MoE layer, compared exactly in every layout below
    assert all(sum(c) > 0 for step in ref.values() for c in step["moe_load"].values()), ref
    assert ref[1]["moe/load_imbalance"] >= 1.0
    layouts = [
        {"dp": 4, "ep": 2, "zero": 1, "skewed": True, "save": saved},
        {"dp": 2, "ep": 2, "tp": 2, "mode": "REDUCE_SCATTER"},
        {
            "dp": 2,
            "ep": 2,
            "pp": 2,
            "engine": "zb-h1",
            "dispatcher": "allgather",
            "recompute": True,
        },
        {"dp": 2, "ep": 2, "cp": 2, "dispatcher": "allgather"},
        {"dp": 4, "ep": 2, "zero": 3},
        {"dp": 4, "ep": 2, "zero": 1, "skewed": True, "resume": f"{saved}/2"},
        {"dp": 4, "ep": 1, "zero": 1, "skewed": True, "resume": f"{saved}/2"},
    ]
    ranks = run_distributed(launch, 4, layouts, timeout=400)
    results = ranks[0]["trained"]
    # A step's host reads: each dispatcher reads its split sizes once per MoE layer and
    # micro-batch (2 layers, 1 micro-batch per dp rank); no other device sync. On the CPU
    # torch's grouped matmul reads its offsets (2 reads a call forward, 4 backward; 2 calls a
    # layer); the CUDA kernel takes them on the device.
    for rank in ranks:
        for kind, reads in rank["syncs"].items():
            assert (reads["split_sizes"], reads["sync"], reads["grouped_mm"]) == (2, 0, 24), kind
    expected = [skewed, ref, ref, ref, ref]
    for layout, got, want in zip(layouts, results, expected):
        _close(got, want, layout)
    # Resumed at step 2: the same layout continues bitwise, ep=1 within 1e-5.
    assert results[5] == {3: results[0][3]}
    _close(results[6], {3: skewed[3]}, layouts[6])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"ep": 2, "dp": 1}, "must divide parallelism.dp=1: expert-parallel ranks are data"),
        ({"ep": 3, "dp": 3}, "must divide model.model_config.moe_config.num_experts=4"),
    ],
)
def test_expert_parallel_layouts_that_cannot_work_are_one_line(change: dict, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(moe_config(change), "moe.yaml", world_size=None)
    text = str(err.value)
    assert text.startswith("moe.yaml: parallelism.expert_parallel_size: ") and "\n" not in text
    assert words in text


def test_expert_parallel_needs_experts() -> None:
    data = moe_config({"ep": 2, "dp": 2})
    data["model"]["model_config"]["moe_config"] = None
    with pytest.raises(ConfigError, match="expert_parallel_size: 2 needs a mixture-of-experts"):
        config_from_dict(data, "moe.yaml", world_size=None)
