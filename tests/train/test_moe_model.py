"""Nanotron's config_qwen_with_moe.yaml here: it loads with Nanotron's meanings (8 experts,
top-1, a shared expert on every layer, Nanotron's defaults for the rest), every moe_config
refusal is one line naming its key, and with only sizes, layout and paths changed it trains
in one process (bf16, as written) with the expected parameter count and active FLOPs; the
convert commands take a Hugging Face Qwen2-MoE folder in and write it back unchanged."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_train.config import ConfigError, config_from_dict, load_config

QWEN_MOE = Path(__file__).parent / "nanotron" / "config_qwen_with_moe.yaml"
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
MOE_SIZES = dict(moe_intermediate_size=16, shared_expert_intermediate_size=24)


def _example() -> dict:
    return yaml.safe_load(QWEN_MOE.read_text())


def test_config_qwen_with_moe_loads_with_nanotron_meanings():
    mc = load_config(QWEN_MOE, world_size=2).model.model_config
    m = mc.moe_config
    assert (m.num_experts, m.top_k, m.enable_shared_expert) == (8, 1, True)
    assert (m.moe_intermediate_size, m.shared_expert_intermediate_size) == (1408, 5632)
    assert (m.router_aux_loss_coef, m.token_dispatcher_type, m.router) == (
        0.01,
        "alltoall",
        "softmax",
    )
    assert m.moe_layers(mc.num_hidden_layers) == list(range(12))


def test_configuration_doc_lists_every_moe_key_with_its_default():
    import dataclasses
    import re

    from nanotron_models.moe import MoEConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    block = text.split("`moe_config` (Nanotron's `MoEConfig` keys")[1].split("\n\n")[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", block, flags=re.M))
    fields = {f.name: getattr(MoEConfig(), f.name) for f in dataclasses.fields(MoEConfig)}
    assert list(rows) == list(fields)
    assert {k: yaml.safe_load(v.strip().strip("`")) for k, v in rows.items()} == fields


REFUSED = {
    "top_k": (9, "top_k (9) must be at most num_experts (8)"),
    "layers": ([0, 12], "layers [12] are outside 0..11"),
    "token_dispatcher_type": ("ring", "must be one of ['alltoall', 'allgather']"),
    "router": ("hash", "must be one of ['softmax', 'sigmoid_bias']"),
    "num_experts": (0, "must be a positive integer"),
    "router_z_loss_coef": (-1.0, "must be a number >= 0"),
    "unknown_key": (1, "unknown key"),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_moe_config_refusals_are_one_line_naming_the_key(key):
    value, expect = REFUSED[key]
    data = _example()
    data["model"]["model_config"]["moe_config"][key] = value
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, "q.yaml", world_size=2)
    text = str(err.value)
    assert text.startswith(f"q.yaml: model.model_config.moe_config.{key}: ") and "\n" not in text
    assert expect in text, text


def expected_parameters(mc) -> tuple[int, int]:
    """(every parameter, the matmul weights one token runs through), written out by hand."""
    h, v, layers = mc.hidden_size, mc.vocab_size, mc.num_hidden_layers
    m = mc.moe_config
    attn = h * (4 + 2 * 2) * (h // 4) + h * h  # qkv (4 heads, 2 kv heads) and o_proj
    shared = 3 * h * m.shared_expert_intermediate_size + h  # SwiGLU + its sigmoid gate
    routed = 3 * h * m.moe_intermediate_size
    total = v * h + layers * (attn + 2 * h + h * m.num_experts + m.num_experts * routed + shared)
    active = layers * (attn + h * m.num_experts + m.top_k * routed + shared) + v * h
    return total + h, active  # + final norm; tied embeddings: one V x h table


def test_config_qwen_with_moe_trains_with_sizes_layout_and_paths_changed(tmp_path, monkeypatch):
    from nanotron_models import family_of
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.data.testing import make_id_nanoset
    from nanotron_train.interop.nanotron_names import from_nanotron, to_nanotron
    from nanotron_train.model_factory import build_model
    from nanotron_train.trainer import train

    monkeypatch.chdir(tmp_path)
    data = _example()
    data["model"]["model_config"].update(SIZES)
    data["model"]["model_config"]["moe_config"].update(MOE_SIZES)
    data["tokens"].update(sequence_length=32, micro_batch_size=2, train_steps=2)
    data["tokens"]["batch_accumulation_per_replica"] = 2
    data["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = 2
    folder = make_id_nanoset(tmp_path / "ns", [20, 45, 9, 70] * 4, high=8, seed=1)
    dataset = data["data_stages"][0]["data"]["dataset"]
    dataset.update(dataset_folder=[str(folder)], tokenizer_name=None, vocab_size=256,
                   token_size_in_bytes=2)  # fmt: skip
    data["tokenizer"]["tokenizer_name_or_path"] = None
    data["parallelism"].update(dp=1, tp=1)
    data["checkpoints"]["checkpoints_path"] = "checkpoints"  # its path is on Nanotron's cluster
    cfg = config_from_dict(data, "q.yaml", world_size=1)
    mc = cfg.model.model_config
    total, active = expected_parameters(mc)
    fam = family_of(mc)
    assert fam.num_parameters(mc) == total
    # active weights; attention over the 20 keys of the window on both layers
    assert fam.training_flops_per_token(mc, 32) == 6 * active + 12 * mc.hidden_size * 2 * 20
    pc = ParallelContext(1, 1, 1)
    model = build_model(cfg.model, 42, 32, pc)
    assert sum(p.numel() for p in model.parameters()) == total
    names = [n for n, _ in model.named_parameters()]  # Nanotron's names of every one, both ways
    assert [from_nanotron(to_nanotron(n)) for n in names] == names
    assert to_nanotron("decoder.1.mlp.experts.gate_up_proj").endswith("merged_gate_up_proj")
    assert model.decoder["0"].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    records: list[dict] = []
    train(cfg, pc, stream=io.StringIO(), on_record=records.append)
    losses = [r["lm_loss"] for r in records]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(256), abs=0.15) and losses[1] != losses[0]
    assert (tmp_path / "checkpoints" / "2").is_dir()


def test_convert_qwen2_moe_folder_from_hf_and_back(tmp_path):
    """A transformers Qwen2MoeForCausalLM folder (experts stored per expert, as the Hub has
    them; layer 0 dense) -> our checkpoint -> a folder transformers loads with every tensor
    and the MoE config unchanged."""
    import transformers

    from nanotron_models.hf_qwen2_moe import qwen2_moe_config_to_hf
    from nanotron_models.moe import MoEConfig
    from nanotron_models.qwen2 import Qwen2Config
    from nanotron_train.convert import main as convert_main

    moe = MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=16, layers=[1],
                    shared_expert_intermediate_size=24, enable_shared_expert=True)  # fmt: skip
    ours = Qwen2Config(**SIZES, attention_bias=True, moe_config=moe, bos_token_id=0,
                       eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen2MoeForCausalLM(qwen2_moe_config_to_hf(ours)).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "experts" in name:  # transformers leaves them uninitialised
                p.normal_(0.0, 0.02)
    hf.save_pretrained(tmp_path / "hf")
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert convert_main(["from-hf", "--hf-path", str(tmp_path / "hf"), "--out", str(ckpt)]) == 0
    mc = load_config(ckpt / "0" / "config.yaml").model.model_config
    assert mc.moe_config.moe_layers(2) == [1] and mc.moe_config.enable_shared_expert
    assert (
        convert_main(["to-hf", "--ckpt-path", str(ckpt), "--out", str(back), "--no-tokenizer"]) == 0
    )
    again = transformers.AutoModelForCausalLM.from_pretrained(back).float()
    assert type(again).__name__ == "Qwen2MoeForCausalLM"
    assert again.config.mlp_only_layers == [0] and again.config.num_experts_per_tok == 2
    theirs = hf.state_dict()
    assert sorted(again.state_dict()) == sorted(theirs)
    assert all(torch.equal(t, theirs[k]) for k, t in again.state_dict().items())


def test_sigmoid_bias_router_resumes_exactly_with_its_biases(tmp_path):
    """The expert biases are state the training loop moves: a checkpoint keeps them, so a run
    resumed at step 2 ends bitwise as the run that never stopped (biases and losses)."""
    from nanotron_models.moe import moe_blocks
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    def run(resume: str | None) -> tuple[list[float], list[list[float]]]:
        data = _example()
        data["model"]["model_config"].update(SIZES, sliding_window_size=None)
        moe = data["model"]["model_config"]["moe_config"]
        moe.update(MOE_SIZES, router="sigmoid_bias", router_bias_update_rate=0.01)
        data["model"]["dtype"] = "float32"
        data["tokens"].update(sequence_length=16, micro_batch_size=2, train_steps=3)
        data["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = 3
        data["data_stages"][0]["data"]["dataset"] = None  # synthetic tokens
        data["tokenizer"]["tokenizer_name_or_path"] = None
        data["parallelism"].update(dp=1, tp=1)
        out = tmp_path / ("again" if resume else "ckpt")
        data["checkpoints"].update(checkpoints_path=str(out), checkpoint_interval=2)
        data["checkpoints"]["resume_checkpoint_path"] = resume
        cfg = config_from_dict(data, "q.yaml", world_size=1)
        pc = ParallelContext(1, 1, 1)
        try:
            trainer, records = Trainer(cfg, pc, stream=io.StringIO()), []
            trainer.train(on_record=records.append)
            biases = [b.router.expert_bias.tolist() for _, b in moe_blocks(trainer.state.model)]
        finally:
            pc.destroy()
        return [r["lm_loss"] for r in records], biases

    whole_losses, whole_biases = run(None)
    assert any(x != 0.0 for layer in whole_biases for x in layer)
    resumed_losses, resumed_biases = run(str(tmp_path / "ckpt" / "2"))
    assert resumed_losses == whole_losses[2:] and resumed_biases == whole_biases


def _zb_config(layout: dict) -> dict:
    """The Nanotron MoE example at test sizes (fp32, synthetic tokens, 4 micro-batches, an aux
    and a z-loss that weigh) on `layout`'s pipeline."""
    data = _example()
    data["model"]["model_config"].update(SIZES, sliding_window_size=None)
    moe = data["model"]["model_config"]["moe_config"]
    moe.update(MOE_SIZES, top_k=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
    data["model"]["dtype"] = "float32"
    data["tokens"].update(sequence_length=16, micro_batch_size=1, train_steps=2)
    data["tokens"]["batch_accumulation_per_replica"] = 4
    data["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = 2
    data["data_stages"][0]["data"]["dataset"] = None
    data["tokenizer"]["tokenizer_name_or_path"] = None
    data["checkpoints"].update(checkpoints_path=None, save_final_state=False)
    par = data["parallelism"]
    par.update(dp=1, tp=1, pp=layout.get("pp", 1), pp_engine=layout.get("engine", "1f1b"))
    par["recompute_layer"] = layout.get("recompute", False)
    return data


def _zb_train(layouts: list[dict]) -> list[list[tuple]]:
    """Each layout's (lm_loss, grad_norm, moe/aux_loss) per step (holding the default group)."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for layout in layouts:
            cfg = config_from_dict(_zb_config(layout), "moe.yaml", world_size=None)
            pc = ParallelContext(pp=cfg.parallelism.pp)
            try:
                records: list[dict] = []
                Trainer(cfg, pc, stream=io.StringIO()).train(on_record=records.append)
            finally:
                pc.destroy()
            out.append([(r["lm_loss"], r["grad_norm"], r["moe/aux_loss"]) for r in records])
    return out


def test_zero_bubble_split_trains_the_one_process_moe():
    """pp=2 under zb-h1 (B and W apart: the experts' and router's weight gradients come in B,
    the balance losses' through their scaler), recompute on: every step's lm_loss, grad_norm
    and aux loss within 1e-5 of one process."""
    from nanotron_parallel.testing import run_distributed

    (ref,) = _zb_train([{}])
    layouts = [{"pp": 2, "engine": "zb-h1", "recompute": True}]
    for got in run_distributed(_zb_train, 2, layouts, timeout=300)[0]:
        assert len(got) == len(ref) == 2
        for a, b in zip(got, ref):
            assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (a, b)
