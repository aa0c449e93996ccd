"""The commands for the Qwen2 family: a Hugging Face SmolLM3 folder (NoPE layers, a sliding
window shorter than the generation) imported with from-hf, continued by our generate command
exactly as transformers' greedy decoding, and written back by to-hf to a
folder transformers loads with the same tensors and config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

VOCAB = 300


@pytest.fixture(scope="module")
def smollm3_dir(tmp_path_factory) -> Path:
    import transformers

    from nanotron_train.data.testing import make_tokenizer, tiny_texts
    from nanotron_train.interop.hf_folder import copy_tokenizer_files

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("qwen2conv")
    tok = make_tokenizer(root / "tok", tiny_texts(60), vocab_size=VOCAB)
    config = transformers.SmolLM3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        rope_theta=50000.0, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True,
        initializer_range=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.SmolLM3ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = root / "hf"
    model.save_pretrained(out)
    copy_tokenizer_files(tok, out)
    return out


def test_smollm3_from_hf_generate_and_back_to_hf(smollm3_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from nanotron_train.config import load_config
    from nanotron_train.convert import main as convert_main
    from nanotron_train.generate import main as generate_main

    ckpt = tmp_path / "ckpt"
    assert convert_main(["from-hf", "--hf-path", str(smollm3_dir), "--out", str(ckpt)]) == 0
    mc = load_config(ckpt / "0" / "config.yaml").model.model_config
    assert type(mc).__name__ == "Qwen2Config"
    assert (mc.no_rope_layer, mc.sliding_window_size, mc.attention_bias) == (2, 6, False)
    report = tmp_path / "gen.json"
    args = ["--ckpt-path", str(ckpt), "--max-new-tokens", "12", "--output-json", str(report)]
    assert generate_main([*args, "--prompt", "def model", "--prompt", "the loss of"]) == 0
    capsys.readouterr()
    hf = AutoModelForCausalLM.from_pretrained(smollm3_dir).float().eval()
    for item in json.loads(report.read_text())["results"]:
        prompt = torch.tensor([item["prompt_ids"]])
        out = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        assert out[0, prompt.shape[1] :].tolist()[: len(item["new_ids"])] == item["new_ids"]
        assert prompt.shape[1] + len(item["new_ids"]) > 6  # past the window
    back = tmp_path / "back"
    assert convert_main(["to-hf", "--ckpt-path", str(ckpt), "--out", str(back)]) == 0
    again = AutoModelForCausalLM.from_pretrained(back).float().eval()
    assert type(again).__name__ == "SmolLM3ForCausalLM"
    assert again.config.no_rope_layers == hf.config.no_rope_layers
    assert again.config.layer_types == hf.config.layer_types
    theirs = hf.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in again.state_dict().items())
