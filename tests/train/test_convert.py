"""Import of a Hugging Face Llama, and the clear errors of generate and convert.

A random tiny transformers LlamaForCausalLM (GQA, untied, Llama-3 RoPE scaling, norms
randomised) with a BPE tokenizer is imported with from-hf. Our generate command then produces
transformers' greedy tokens, and the trainer resumes from the checkpoint at tp=1 and tp=2 with
a first-step loss equal to transformers' loss on the same batch.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanotron_parallel.testing import run_distributed

VOCAB, SEQ, MBS = 300, 16, 2


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    import transformers

    from nanotron_train.data.testing import make_tokenizer, tiny_texts
    from nanotron_train.interop.hf_folder import copy_tokenizer_files

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("conv")
    tok = make_tokenizer(root / "tok", tiny_texts(60), vocab_size=VOCAB)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        rope_theta=500000.0, tie_word_embeddings=False, initializer_range=0.1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():  # HF leaves norms at 1: randomise them so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = root / "hf"
    model.save_pretrained(out)
    copy_tokenizer_files(tok, out)
    return out


def _hf_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()


def test_from_hf_then_generate_matches_transformers(hf_dir, tmp_path, capsys):
    from nanotron_train.config import load_config
    from nanotron_train.convert import main as convert_main
    from nanotron_train.generate import main as generate_main

    ckpt = tmp_path / "ckpt"
    assert convert_main(["from-hf", "--hf-path", str(hf_dir), "--out", str(ckpt)]) == 0
    assert (ckpt / "latest.txt").read_text().strip() == "0"
    cfg = load_config(ckpt / "0" / "config.yaml")  # the derived config is a valid one
    assert cfg.tokenizer.tokenizer_name_or_path == str((ckpt / "tokenizer").resolve())
    assert cfg.model.model_config.rope_scaling["factor"] == 8.0
    assert cfg.checkpoints.resume_checkpoint_path == str(ckpt.resolve())
    prompts = ["def model", "the loss of data for", "λ"]
    report = tmp_path / "gen.json"
    args = ["--ckpt-path", str(ckpt), "--max-new-tokens", "12", "--output-json", str(report)]
    assert generate_main([*args, *(a for p in prompts for a in ("--prompt", p))]) == 0
    capsys.readouterr()
    results = json.loads(report.read_text())["results"]
    hf = _hf_model(hf_dir)
    for item in results:
        prompt = torch.tensor([item["prompt_ids"]])
        out = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
            do_sample=False, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        assert out[0, prompt.shape[1] :].tolist() == item["new_ids"], item["prompt"]
    assert len({tuple(r["new_ids"]) for r in results}) == 3  # the prompts led somewhere apart


def _finetune_config(ckpt: Path, tp: int) -> dict:
    return {
        "general": {"project": "t", "run": "ft", "seed": 7},
        "parallelism": {"dp": 1, "tp": tp, "pp": 1},
        "model": {
            "model_config": {
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
                "max_position_embeddings": 64, "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                "bos_token_id": 0, "eos_token_id": 0,
            },
            "dtype": "float32",  # Nanotron's default is bfloat16
        },
        "tokens": {"sequence_length": SEQ, "micro_batch_size": MBS,
                   "batch_accumulation_per_replica": 1, "train_steps": 1},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-3}},
        "checkpoints": {"checkpoints_path": None, "resume_checkpoint_path": str(ckpt)},
        "data_stages": [{"name": "s", "start_training_step": 1, "data": {"dataset": None, "seed": 4}}],
        "logging": {"iteration_step_info_interval": 1},
    }  # fmt: skip


def _resume_job(ckpt: str, tp: int) -> float:
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import train

    torch.set_num_threads(1)
    record = train(config_from_dict(_finetune_config(Path(ckpt), tp)), stream=io.StringIO())
    return record["lm_loss"]


def test_from_hf_checkpoint_resumes_in_trainer_at_tp1_and_tp2(hf_dir, tmp_path):
    import yaml

    from nanotron_train.convert import main
    from nanotron_train.data.synthetic import SyntheticData

    config_file = tmp_path / "ft.yaml"
    config_file.write_text(yaml.safe_dump(_finetune_config(tmp_path / "unused", 1)))
    ckpt = tmp_path / "ckpt"
    args = ["from-hf", "--hf-path", str(hf_dir), "--out", str(ckpt)]
    assert main([*args, "--config-file", str(config_file)]) == 0
    batch = SyntheticData(4, SEQ, VOCAB, MBS, 1, 1, 0).micro_batches(1)[0]
    with torch.no_grad():
        logits = _hf_model(hf_dir)(batch["input_ids"]).logits
    expected = float(
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["label_ids"].flatten())
    )
    assert abs(_resume_job(str(ckpt), 1) - expected) < 1e-5 * expected
    tp2 = run_distributed(_resume_job, 2, str(ckpt), 2, timeout=120)
    assert abs(tp2[0] - expected) < 1e-5 * expected


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and "Traceback" not in err
    return err


def test_bad_inputs_are_one_line_errors_with_status_2(hf_dir, tmp_path, capsys):
    from nanotron_train.convert import main as convert
    from nanotron_train.generate import main as generate

    not_ckpt = tmp_path / "empty"
    not_ckpt.mkdir()
    assert generate(["--ckpt-path", str(not_ckpt), "--prompt", "x"]) == 2
    assert "not a complete checkpoint" in _error_line(capsys)
    assert (
        convert(["to-hf", "--ckpt-path", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    )
    assert "no such checkpoint" in _error_line(capsys)
    assert not (tmp_path / "o").exists()
    # A Hugging Face folder that is not a Llama; one without weights.
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    assert convert(["from-hf", "--hf-path", str(gpt2), "--out", str(tmp_path / "c1")]) == 2
    assert "'gpt2'" in _error_line(capsys) and not (tmp_path / "c1").exists()
    (gpt2 / "config.json").write_text((hf_dir / "config.json").read_text())
    assert convert(["from-hf", "--hf-path", str(gpt2), "--out", str(tmp_path / "c1")]) == 2
    assert "no model.safetensors" in _error_line(capsys)
    # A checkpoint without a tokenizer: generate and to-hf name the missing setting.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((hf_dir / name).read_bytes())
    ckpt = tmp_path / "c2"
    assert convert(["from-hf", "--hf-path", str(bare), "--out", str(ckpt)]) == 0
    capsys.readouterr()
    assert generate(["--ckpt-path", str(ckpt), "--prompt", "x"]) == 2
    assert "tokenizer.tokenizer_name_or_path is not set" in _error_line(capsys)
    assert convert(["to-hf", "--ckpt-path", str(ckpt), "--out", str(tmp_path / "h")]) == 2
    assert "tokenizer" in _error_line(capsys) and not (tmp_path / "h").exists()
    assert (
        convert(["to-hf", "--ckpt-path", str(ckpt), "--out", str(tmp_path / "h"), "--no-tokenizer"])
        == 0
    )
    assert convert(["to-hf", "--ckpt-path", str(ckpt), "--out", str(tmp_path / "h")]) == 2
    assert "already exists" in _error_line(capsys)
    # Layouts generate cannot run; a config that describes another model.
    assert generate(["--ckpt-path", str(ckpt), "--prompt", "x", "--pp", "2"]) == 2
    assert "--pp 2 must divide the number of processes (1)" in _error_line(capsys)
    assert generate(["--ckpt-path", str(ckpt), "--prompt", "x", "--tp", "2"]) == 2
    assert "nproc_per_node=2" in _error_line(capsys)
    cfg = _finetune_config(ckpt, 1)
    cfg["model"]["model_config"]["hidden_size"] = 32
    import yaml

    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    args = ["from-hf", "--hf-path", str(hf_dir), "--out", str(tmp_path / "c3")]
    assert convert([*args, "--config-file", str(tmp_path / "bad.yaml")]) == 2
    assert "hidden_size: config 32, HF 64" in _error_line(capsys)


def test_command_line_entry_points_exit_2_with_one_line(tmp_path):
    cmd = [sys.executable, "-m", "nanotron_train.convert", "to-hf", "--ckpt-path"]
    proc = subprocess.run([*cmd, str(tmp_path / "x"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("error: ") and "no such checkpoint" in proc.stderr
