"""Nanotron's Qwen2 and Qwen2-MoE checkpoints import as its Llama ones do: a small random model
written in Nanotron's layout (tp = 2, pp = 2; nanotron_qwen2_writer.py) from Nanotron's own
example configs at test sizes, imported with `convert from-nanotron`: the weights come back
exactly, the step and config with them, and the imported model's logits are those of the
model the weights came from."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from tests.train.nanotron_qwen2_writer import write_nanotron_qwen2

NANOTRON = Path(__file__).parent / "nanotron"
SIZES = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    sliding_window_size=None, _attn_implementation="sdpa",
)  # fmt: skip
MOE = dict(num_experts=4, top_k=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
MODELS = {
    # Qwen2 proper: q/k/v biases, an untied head
    "qwen2": ("config_qwen.yaml", dict(attention_bias=True, tie_word_embeddings=False)),
    # Qwen2-MoE: both layers sparse (a router, 4 experts, a shared expert), a tied head
    "qwen2-moe": ("config_qwen_with_moe.yaml", {}),
}


def nanotron_config(model: str) -> dict:
    file, changes = MODELS[model]
    config = yaml.safe_load((NANOTRON / file).read_text())
    mc = config["model"]["model_config"]
    mc.update(SIZES, **changes)
    if mc.get("moe_config"):
        mc["moe_config"].update(MOE)
    config["model"]["dtype"] = "float32"
    config["tokens"]["sequence_length"] = 32
    for stage in config["data_stages"]:  # its data, sized for the model (only sizes change)
        stage["data"]["dataset"]["vocab_size"] = SIZES["vocab_size"]
    config["general"].update(step=10, consumed_train_samples=40)
    return config


def _built(config: dict):
    """Our model of `config`, random, and its full state dict (one process)."""
    from nanotron_models import build_llama, config_from_dict
    from nanotron_models.model import full_state_dict
    from nanotron_parallel.context import ParallelContext

    pc = ParallelContext()
    mc = config_from_dict(copy.deepcopy(config["model"]["model_config"]))
    model = build_llama(mc, pc, dtype=torch.float32, seed=123)
    return model, full_state_dict(model), pc


@pytest.mark.parametrize("model", sorted(MODELS))
def test_from_nanotron_imports_qwen2_weights_exactly_with_the_same_logits(tmp_path, model):
    from nanotron_train.convert import main as convert_main
    from nanotron_train.inference.model_io import full_model_tensors, load_model, open_checkpoint

    config = nanotron_config(model)
    ours, original, pc = _built(config)
    try:
        # the MoE run's loader counted no tokens per folder: 0 recorded, derived on import
        by_folder = model == "qwen2"
        write_nanotron_qwen2(tmp_path / "nt" / "10", original, config, 10, 40, by_folder)
        out = tmp_path / "ours"
        argv = ["from-nanotron", "--nanotron-path", str(tmp_path / "nt"), "--out", str(out)]
        assert convert_main(argv) == 0
        ckpt = open_checkpoint(out)
        assert ckpt.folder == out / "10" and ckpt.metadata["consumed_samples"] == 40
        assert ckpt.metadata["consumed_tokens"] == 40 * 32
        assert type(ckpt.model_config).__name__ == "Qwen2Config"
        assert ckpt.model_config.to_dict() == ours.config.to_dict()
        got = full_model_tensors(ckpt)
        tied = config["model"]["model_config"]["tie_word_embeddings"]
        assert sorted(got) == sorted(n for n in original if not (tied and n == "lm_head.weight"))
        assert all(torch.equal(got[n], original[n]) for n in got)  # exact
        ids = torch.randint(
            0, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad():
            want = ours.logits(ids)
            imported = load_model(ckpt, pc)
            torch.testing.assert_close(imported.logits(ids), want, rtol=0, atol=1e-5)
    finally:
        pc.destroy()


def test_from_nanotron_refuses_the_experts_of_one_expert_parallel_rank(tmp_path, capsys):
    """Nanotron's experts are plain parameters tied over tp, never marked expert-sharded: at
    expert_parallel_size > 1 every ep rank writes its own experts to the same file, which then
    holds num_experts / ep of them. That is refused in one line, not imported half-empty."""
    from safetensors.torch import save_file

    from nanotron_train.convert import main as convert_main

    config = nanotron_config("qwen2-moe")
    config["parallelism"]["expert_parallel_size"] = 2
    _, original, pc = _built(config)
    pc.destroy()
    write_nanotron_qwen2(tmp_path / "nt" / "10", original, config, 10, 40, True)
    file = next((tmp_path / "nt").rglob("experts/model_merged_gate_up_proj.safetensors"))
    save_file({"data": original["decoder.0.mlp.experts.gate_up_proj"][2:].contiguous()}, str(file))
    argv = ["from-nanotron", "--nanotron-path", str(tmp_path / "nt"), "--out", str(tmp_path / "o")]
    assert convert_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(file) in err
    assert "2 of moe_config.num_experts=4 experts" in err and "expert_parallel_size" in err
    assert not (tmp_path / "o" / "10").exists()
