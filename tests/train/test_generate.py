"""Generation from a trained checkpoint, its Hugging Face export, and the round trip.

A tiny Llama (tied embeddings, GQA, vocab padded 300 -> 304, rope_theta 5e5) trains 8 steps on
text tokenized with a freshly trained BPE, with checkpoints on. Then: our generate command at
tp=1 (batched prompts of different lengths) equals each prompt decoded alone and transformers'
generate on the exported folder, token for token; tp=2 (two gloo processes) gives the same
tokens, and seeded sampling agrees on both tp ranks; ours -> HF -> ours is bitwise.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from nanotron_parallel.testing import run_distributed

PROMPTS = ["def model", "the loss of data", "", "import"]
MAX_NEW = 10


def _config(root: Path, tok: Path, nanoset: Path) -> dict:
    return {
        "general": {"project": "t", "run": "gen", "seed": 1},
        "model": {
            "model_config": {
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
                "max_position_embeddings": 64, "rope_theta": 500000.0,
                "tie_word_embeddings": True,
            },
            "init_method": {"std": 0.05},
            "make_vocab_size_divisible_by": 8,
            "dtype": "float32",  # Nanotron's default is bfloat16
        },
        "tokenizer": {"tokenizer_name_or_path": str(tok)},
        "tokens": {
            "sequence_length": 32, "micro_batch_size": 4,
            "batch_accumulation_per_replica": 1, "train_steps": 8,
        },
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 1}},
        "checkpoints": {"checkpoints_path": str(root / "ckpt"), "checkpoint_interval": 8},
        "data_stages": [
            {"name": "s", "start_training_step": 1,
             "data": {"dataset": {"dataset_folder": str(nanoset)}, "seed": 2}},
        ],
        "logging": {"iteration_step_info_interval": 1},
    }  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Train, generate at tp=1 (command, JSON out) and export to HF; shared by the tests."""
    from nanotron_train.config import config_from_dict
    from nanotron_train.convert import main as convert_main
    from nanotron_train.data import tokenize_to_nanoset
    from nanotron_train.data.testing import make_tokenizer, tiny_texts
    from nanotron_train.generate import main as generate_main
    from nanotron_train.trainer import train

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gen")
    tok = make_tokenizer(root / "tok", tiny_texts(60), vocab_size=300)
    docs = root / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in tiny_texts(120, seed=1)))
    nanoset = tokenize_to_nanoset([str(docs)], str(tok), root / "ns", progress=False, num_workers=1)
    records: list[dict] = []
    cfg = config_from_dict(_config(root, tok, nanoset))
    train(cfg, stream=io.StringIO(), on_record=records.append)
    assert len(records) == 8 and records[-1]["lm_loss"] < records[0]["lm_loss"]
    out_json = root / "tp1.json"
    args = ["--ckpt-path", str(root / "ckpt"), "--max-new-tokens", str(MAX_NEW)]
    args += [a for p in PROMPTS for a in ("--prompt", p)]
    assert generate_main([*args, "--output-json", str(out_json)]) == 0
    hf_dir = root / "hf"
    assert convert_main(["to-hf", "--ckpt-path", str(root / "ckpt"), "--out", str(hf_dir)]) == 0
    return {
        "root": root,
        "ckpt": root / "ckpt" / "8",
        "tok": tok,
        "args": args,
        "tp1": json.loads(out_json.read_text()),
        "hf": hf_dir,
    }


def test_generate_prints_and_matches_unbatched_decoding(trained, capsys):
    from nanotron_models import KVCache
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.generate import main
    from nanotron_train.inference.decoding import generate, pad_prompts
    from nanotron_train.inference.model_io import load_model, open_checkpoint

    assert main([*trained["args"][:4], "--prompt", "def"]) == 0
    out = capsys.readouterr().out
    assert "=== [0] prompt" in out and "continuation" in out and "tokens/s (tp=1, pp=1)" in out
    report = trained["tp1"]
    assert [r["prompt"] for r in report["results"]] == PROMPTS
    assert report["decode_tokens"] > 0 and report["decode_tokens_per_s"] > 0
    pc = ParallelContext()
    try:
        model = load_model(open_checkpoint(trained["ckpt"]), pc)
        # The padded batch's prompt logits are each prompt's own (padding is invisible).
        prompts = [item["prompt_ids"] for item in report["results"]]
        ids, positions, mask = pad_prompts(prompts, 0, 0, "cpu")
        batched = model.logits(ids, positions, KVCache(), mask)
        for row, p in enumerate(prompts):
            alone = model.logits(torch.tensor([p]))[0]
            assert float((batched[row, -len(p) :] - alone).abs().max()) < 1e-5 * float(
                alone.abs().max()
            )
        for item in report["results"]:  # each prompt alone: no padding at all
            alone = generate(model, [item["prompt_ids"]], MAX_NEW, eos_token_id=0, pad_token_id=0)
            assert alone.tokens[0] == item["new_ids"], item["prompt"]
            assert 1 <= len(item["new_ids"]) <= MAX_NEW
    finally:
        pc.destroy()


def test_hf_export_loads_in_transformers_with_same_logits_and_greedy_tokens(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.inference.model_io import load_model, open_checkpoint

    hf_dir = trained["hf"]
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 304
    assert config["rope_parameters"]["rope_theta"] == 500000.0 and config["eos_token_id"] == 0
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = torch.randint(0, 304, (3, 20), generator=torch.Generator().manual_seed(0))
    pc = ParallelContext()
    try:
        ours = load_model(open_checkpoint(trained["ckpt"]), pc).logits(ids)
    finally:
        pc.destroy()
    with torch.no_grad():
        theirs = hf(ids).logits
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    assert err < 1e-5
    for item in trained["tp1"]["results"]:
        if item["prompt"]:
            assert tok(item["prompt"])["input_ids"] == item["prompt_ids"]
        prompt = torch.tensor([item["prompt_ids"]])
        out = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW,
            do_sample=False, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        assert out[0, prompt.shape[1] :].tolist() == item["new_ids"], item["prompt"]


def _tp2_job(args: list[str], out_json: str, ckpt: str) -> list[int]:
    """On each of 2 ranks: the generate command at tp=2 and at pp=2, then seeded sampling."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.generate import main
    from nanotron_train.inference.decoding import generate
    from nanotron_train.inference.model_io import load_model, open_checkpoint
    from nanotron_train.inference.sampling import SamplingParams

    dist.init_process_group("gloo", init_method="env://")
    assert main([*args, "--tp", "2", "--output-json", out_json]) == 0
    assert main([*args, "--pp", "2", "--output-json", out_json.replace("tp2", "pp2")]) == 0
    pc = ParallelContext(tp=2)
    model = load_model(open_checkpoint(ckpt), pc)
    sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=3)
    res = generate(model, [[5, 6, 7], [8]], 12, sampling, eos_token_id=None)
    pc.destroy()
    dist.destroy_process_group()
    return res.tokens[0] + res.tokens[1]


def test_tp2_generate_equals_tp1_and_sampling_agrees_on_ranks(trained):
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.inference.decoding import generate
    from nanotron_train.inference.model_io import load_model, open_checkpoint
    from nanotron_train.inference.sampling import SamplingParams

    out_json = trained["root"] / "tp2.json"
    ranks = run_distributed(
        _tp2_job, 2, trained["args"], str(out_json), str(trained["ckpt"]), timeout=120
    )
    tp2 = json.loads(out_json.read_text())
    assert tp2["tp"] == 2
    assert [r["new_ids"] for r in tp2["results"]] == [
        r["new_ids"] for r in trained["tp1"]["results"]
    ]
    pp2 = json.loads((trained["root"] / "pp2.json").read_text())  # pipelined decoding
    assert (pp2["tp"], pp2["pp"]) == (1, 2)
    assert [r["new_ids"] for r in pp2["results"]] == [
        r["new_ids"] for r in trained["tp1"]["results"]
    ]
    assert ranks[0] == ranks[1] and len(ranks[0]) == 24
    pc = ParallelContext()
    try:
        model = load_model(open_checkpoint(trained["ckpt"]), pc)

        def sample(seed: int) -> list[list[int]]:
            params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=seed)
            return generate(model, [[5, 6, 7], [8]], 12, params).tokens

        assert sample(3) == sample(3)
        assert sample(3) != sample(4)
    finally:
        pc.destroy()


def test_round_trip_ours_hf_ours_is_bitwise(trained):
    from nanotron_train.convert import main
    from nanotron_train.inference.model_io import full_model_tensors, open_checkpoint

    out = trained["root"] / "back"
    config = trained["ckpt"] / "config.yaml"
    args = ["from-hf", "--hf-path", str(trained["hf"]), "--out", str(out), "--step", "8"]
    assert main([*args, "--config-file", str(config)]) == 0
    before = full_model_tensors(open_checkpoint(trained["ckpt"]))
    after_ckpt = open_checkpoint(out)
    assert after_ckpt.step == 8
    after = full_model_tensors(after_ckpt)
    assert sorted(before) == sorted(after) and "lm_head.weight" not in after  # tied: stored once
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


def test_top_k_and_top_p_keep_the_expected_tokens():
    from nanotron_train.inference.sampling import SamplingError, SamplingParams, filter_logits

    logits = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).clamp(min=1e-9).log()
    keep = lambda t: torch.isfinite(t)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, 0, 0.6)) == [True, True, False, False]  # 0.5 < 0.6 <= 0.8
    assert keep(filter_logits(logits, 0, 0.5)) == [True, False, False, False]
    assert keep(filter_logits(logits, 3, 1.0)) == [True, True, True, False]
    assert keep(filter_logits(logits, 2, 0.95)) == [True, True, False, False]
    with pytest.raises(SamplingError, match="--top-p"):
        SamplingParams(temperature=1.0, top_p=0.0).validate()
