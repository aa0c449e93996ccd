"""Nanotron's own configs (tests/train/nanotron/, committed unchanged: SOURCE.md) train through
the command a Nanotron user runs, with the quickstart's tokenizer and only sizes, layout and
paths changed by --override.

The tokenizer is the quickstart's (`prepare_default_corpus`: a byte-level BPE trained on
Python's standard library, here on three of its files). The configs keep Nanotron's token ids,
bos 1 and eos 2: `'!'` and `'"'` in that BPE, not special tokens. Each run trains, and says so
in one warning line, from one process, naming the keys and what export and generation use
instead (token_ids.py). The Qwen examples name their Nanoset's tokenizer
(`dataset.tokenizer_name`) by its folder, while the Nanoset's metadata records the
tokenizer.json inside it: the same tokenizer, accepted. config_custom_dl.yaml keeps its layout
(dp=2) under plain torchrun.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from nanotron_parallel.testing import shared_default_group
from nanotron_train.__main__ import main as train_main

HERE = Path(__file__).parent / "nanotron"


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> SimpleNamespace:
    """The quickstart's tokenizer and Nanoset, made as `make run` makes them, from 3 files."""
    from nanotron_train.data import load_tokenizer
    from nanotron_train.data.corpus import prepare_default_corpus

    root = tmp_path_factory.mktemp("quickstart")
    corpus = root / "corpus-py"
    corpus.mkdir()
    for name in ("textwrap.py", "shlex.py", "colorsys.py"):
        shutil.copy(Path(textwrap.__file__).parent / name, corpus / name)
    tok, nanoset = prepare_default_corpus(
        str(root / "cache"), root=str(corpus), progress=False, num_workers=1
    )
    vocab = load_tokenizer(str(tok)).vocab_size
    return SimpleNamespace(corpus=corpus, tokenizer=tok, nanoset=nanoset, vocab=vocab)


def token_id_warnings(err: str) -> list[str]:
    """The warning lines about special token ids (a loaded machine may add a throughput one)."""
    return [line for line in err.splitlines() if "warning: " in line and "_token_id" in line]


def warning(config: Path, q: SimpleNamespace) -> str:
    """The one line each run prints: Nanotron's ids against the quickstart's BPE."""
    tok_file = (q.tokenizer / "tokenizer.json").resolve()
    return (
        f"warning: {config} (with --override): model.model_config.bos_token_id=1 ('!') and "
        "model.model_config.eos_token_id=2 ('\"') are not special tokens of the tokenizer "
        f"{tok_file} (its special tokens: <|endoftext|>=0): training goes on, but export and "
        "generation use bos_token_id=0 (<|endoftext|>), eos_token_id=0 (<|endoftext|>) "
        "instead; set them to special tokens, or null for the tokenizer's"
    )


def common(q: SimpleNamespace) -> list[str]:
    """Every run: the quickstart tokenizer (and the model's vocabulary its size), one process,
    the metrics in a file to read."""
    return [
        f"tokenizer.tokenizer_name_or_path={q.tokenizer}",
        f"model.model_config.vocab_size={q.vocab}",
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "logging.metrics_file=metrics.jsonl",
    ]


def qwen(q: SimpleNamespace) -> list[str]:
    """The Qwen examples: a small model, short sequences, 3 steps, their Nanoset stage on the
    quickstart's Nanoset (uint16 tokens), its tokenizer named by its folder."""
    ds = "data_stages.0.data.dataset"
    mc = "model.model_config"
    return [
        f"{mc}.hidden_size=32", f"{mc}.intermediate_size=64", f"{mc}.num_hidden_layers=2",
        f"{mc}.num_attention_heads=4", f"{mc}.num_key_value_heads=2",
        "tokens.sequence_length=32", "tokens.train_steps=3",
        f"{ds}.dataset_folder=[{q.nanoset}]", f"{ds}.tokenizer_name={q.tokenizer}",
        f"{ds}.vocab_size={q.vocab}", f"{ds}.token_size_in_bytes=2",
    ]  # fmt: skip


EXAMPLES = {
    # its two stages read a raw Hugging Face dataset: the quickstart's files instead
    "config_tiny_llama.yaml": lambda q: [
        f"data_stages.{i}.data.dataset.hf_dataset_or_datasets={q.corpus}" for i in (0, 1)
    ],
    "config_qwen.yaml": qwen,
    "config_qwen_with_moe.yaml": lambda q: [
        *qwen(q),
        "model.model_config.moe_config.moe_intermediate_size=16",
        "model.model_config.moe_config.shared_expert_intermediate_size=24",
        "checkpoints.checkpoints_path=checkpoints",  # its own is on Nanotron's cluster
    ],
}


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def check_trained(folder: Path, raw: dict, q: SimpleNamespace) -> None:
    """Every step logged from a uniform start; the final checkpoint keeps Nanotron's ids."""
    steps = [r["step"] for r in records(folder)]
    losses = [r["lm_loss"] for r in records(folder)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
    assert losses[0] == pytest.approx(math.log(q.vocab), abs=0.1)  # std 0.025: ~uniform
    assert all(math.isfinite(x) for x in losses)
    saved = yaml.safe_load((folder / "checkpoints" / str(steps[-1]) / "config.yaml").read_text())
    mc = saved["model"]["model_config"]
    assert (mc["bos_token_id"], mc["eos_token_id"]) == (1, 2)
    assert raw["model"]["model_config"]["bos_token_id"] == 1  # as committed


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_nanotron_example_trains_with_the_quickstart_tokenizer(
    name, quickstart, tmp_path, monkeypatch, capsys
):
    config = HERE / name
    raw = yaml.safe_load(config.read_text())
    monkeypatch.chdir(tmp_path)  # checkpoints/, .cache/data/ and the metrics file land here
    argv = ["--config-file", str(config)]
    for assignment in [*common(quickstart), *EXAMPLES[name](quickstart)]:
        argv += ["--override", assignment]
    capsys.readouterr()
    with shared_default_group():
        assert train_main(argv) == 0
    err = capsys.readouterr().err
    assert token_id_warnings(err) == [warning(config, quickstart)]
    check_trained(tmp_path, raw, quickstart)


def test_custom_dataloader_example_trains_under_torchrun_with_its_layout(quickstart, tmp_path):
    """config_custom_dl.yaml at dp=2 as Nanotron launches it: a synthetic stage (its `dataset:
    null`), then at step 10 the raw dataset (the quickstart's files); one warning from the two
    processes. Then what export and generation use is what the warning said."""
    from nanotron_train.config.token_ids import generation_eos, ids_for_export
    from nanotron_train.data import load_tokenizer
    from nanotron_train.inference.model_io import open_checkpoint

    config = HERE / "config_custom_dl.yaml"
    argv = ["--config-file", str(config)]
    for assignment in [
        f"tokenizer.tokenizer_name_or_path={quickstart.tokenizer}",
        f"model.model_config.vocab_size={quickstart.vocab}",
        f"data_stages.1.data.dataset.hf_dataset_or_datasets={quickstart.corpus}",
        "logging.metrics_file=metrics.jsonl",
    ]:
        argv += ["--override", assignment]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "NANOTRON_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "nanotron_train", *argv],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert token_id_warnings(proc.stderr) == [warning(config, quickstart)]
    raw = yaml.safe_load(config.read_text())
    check_trained(tmp_path, raw, quickstart)
    assert len(records(tmp_path)) == raw["tokens"]["train_steps"]  # 15: both stages
    ckpt = open_checkpoint(tmp_path / "checkpoints")
    tok = load_tokenizer(str(quickstart.tokenizer))
    ids, notes = ids_for_export(ckpt.model_config, tok)
    assert ids == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None}
    assert generation_eos(ckpt.model_config, tok) == 0 and len(notes) == 2


# -- Nanotron's examples/mamba (Mamba-1): config_mamba.yaml, in the older layout its config.py
# reads (the Adam keys directly under `optimizer`, MambaInit under init_method).


def mamba(q: SimpleNamespace) -> list[str]:
    """Sizes and paths: a small model, short sequences, 3 steps, its TinyStories stage on the
    quickstart's files, its checkpoints here (its own are on Nanotron's cluster)."""
    mc, ds = "model.model_config", "data_stages.0.data.dataset"
    return [
        *common(q), f"{mc}.d_model=16", f"{mc}.num_hidden_layers=2", "tokens.sequence_length=32",
        "tokens.train_steps=3", f"{ds}.hf_dataset_or_datasets={q.corpus}",
        f"{ds}.dataset_processing_num_proc_per_process=1", "checkpoints.checkpoints_path=checkpoints",
    ]  # fmt: skip


def _train(config: Path, overrides: list[str]) -> int:
    argv = ["--config-file", str(config)]
    for assignment in overrides:
        argv += ["--override", assignment]
    with shared_default_group():
        return train_main(argv)


def test_nanotron_mamba_example_trains_with_its_keys(quickstart, tmp_path, monkeypatch, capsys):
    """config_mamba.yaml as committed (bfloat16, residual_in_fp32, tied embeddings) trains 3
    steps; its optimizer-level Adam keys and MambaInit keys mean what they mean in Nanotron."""
    from nanotron_train.config.load import load_config

    config = HERE / "config_mamba.yaml"
    cfg = load_config(config, mamba(quickstart))
    factory, init = cfg.optimizer.optimizer_factory, cfg.model.init_method
    assert (factory.name, factory.adam_beta1, factory.adam_beta2, factory.adam_eps) == (
        "adamW", 0.9, 0.95, 1e-8,
    )  # fmt: skip
    assert (init.initializer_range, init.n_residuals_per_layer) == (0.02, 1)
    assert cfg.model.model_config.ssm_cfg["d_state"] == 16
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert _train(config, mamba(quickstart)) == 0
    assert token_id_warnings(capsys.readouterr().err) == []
    steps = [r["step"] for r in records(tmp_path)]
    losses = [r["lm_loss"] for r in records(tmp_path)]
    assert steps == [1, 2, 3] and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(quickstart.vocab), abs=0.1)  # std 0.02: ~uniform
    saved = yaml.safe_load((tmp_path / "checkpoints" / "3" / "config.yaml").read_text())
    mc = saved["model"]["model_config"]
    assert mc["is_mamba_config"] and mc["residual_in_fp32"] and mc["ssm_cfg"]["dt_rank"] == "auto"
    _converts_to_and_from_hf(tmp_path, quickstart)


def _converts_to_and_from_hf(folder: Path, q: SimpleNamespace) -> None:
    """The trained checkpoint -> MambaForCausalLM (transformers loads it: tied lm_head,
    residual_in_fp32, the sizes) -> our checkpoint again: the same weights both ways, and
    transformers' logits equal ours (float32, 1e-5)."""
    import torch
    from safetensors.torch import load_file
    from transformers import MambaForCausalLM

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.convert import main as convert_main
    from nanotron_train.inference.model_io import full_model_tensors, load_model, open_checkpoint

    hf_dir, back = folder / "hf", folder / "back"
    ids = torch.randint(0, q.vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with shared_default_group():
        assert convert_main(["to-hf", "--ckpt-path", str(folder / "checkpoints"),
                             "--out", str(hf_dir)]) == 0  # fmt: skip
        assert convert_main(["from-hf", "--hf-path", str(hf_dir), "--out", str(back)]) == 0
        ours = load_model(open_checkpoint(back), ParallelContext(), dtype=torch.float32)
        got = ours.logits(ids)
    hf = MambaForCausalLM.from_pretrained(hf_dir).float().eval()
    assert hf.config.tie_word_embeddings and hf.config.residual_in_fp32
    assert (hf.config.intermediate_size, hf.config.time_step_rank) == (32, 1)
    with torch.no_grad():
        want = hf(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    trained = full_model_tensors(open_checkpoint(folder / "checkpoints"))
    again = full_model_tensors(open_checkpoint(back))
    written = load_file(str(hf_dir / "model.safetensors"))
    assert sorted(trained) == sorted(again)
    assert all(torch.equal(trained[k], again[k].to(trained[k].dtype)) for k in trained)
    assert torch.equal(trained["decoder.1.mixer.x_proj.weight"],
                       written["backbone.layers.1.mixer.x_proj.weight"].to(torch.bfloat16))  # fmt: skip


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.model_config.rms_norm=false", "model_config.rms_norm: false (LayerNorm) is not"),
        ("model.model_config.ssm_cfg.d_head=4", "model_config.ssm_cfg.d_head: unknown key"),
        ("model.model_config.dtype=float16", "model.model_config.dtype: 'float16' differs"),
        ("optimizer.optimizer_factory.adam_beta1=0.8", "optimizer.adam_beta1: is also given"),
    ],
)
def test_nanotron_mamba_example_refuses_in_one_line(quickstart, override, message):
    from nanotron_train.config.errors import ConfigError
    from nanotron_train.config.load import load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(HERE / "config_mamba.yaml", [*mamba(quickstart), override])


LAYOUTS = [  # world 2: the example's tp (ALL_REDUCE), sequence parallel, pp with recompute
    {"tp": 2},
    {"tp": 2, "tp_mode": "REDUCE_SCATTER"},
    {"pp": 2, "recompute_layer": True},
]


def _mamba_layout_overrides(layout: dict) -> list[str]:
    """The example (float32, synthetic tokens: no tokenizer in the spawned ranks) at `layout`,
    2 steps; sizes, layout and paths only (and the dtype, for a 1e-5 comparison)."""
    par = {"dp": 1, "tp": 1, "pp": 1, **{k: v for k, v in layout.items() if k != "zero_stage"}}
    mc = "model.model_config"
    return [
        "tokenizer.tokenizer_name_or_path=null", "data_stages.0.data.dataset=null",
        f"{mc}.vocab_size=256", f"{mc}.d_model=16", f"{mc}.num_hidden_layers=4",
        f"{mc}.dtype=null", "model.dtype=float32", "tokens.sequence_length=32",
        "tokens.train_steps=2", "checkpoints.checkpoints_path=null",
        f"optimizer.zero_stage={layout.get('zero_stage', 0)}",
        "tokens.micro_batch_size=" + ("1" if par["dp"] == 2 else "2"),
        *(f"parallelism.{k}={v}" for k, v in par.items()),
    ]  # fmt: skip


def _mamba_curves(layouts: list[dict]) -> list[dict]:
    """Each layout's lm_loss and grad_norm per step, trained in this process group."""
    import io

    import torch
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config.load import load_config
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for layout in layouts:
            cfg = load_config(HERE / "config_mamba.yaml", _mamba_layout_overrides(layout))
            par = cfg.parallelism
            pc = ParallelContext(dp=par.dp, tp=par.tp, pp=par.pp)
            try:
                recs: list[dict] = []
                Trainer(cfg, pc, stream=io.StringIO()).train(on_record=recs.append)
            finally:
                dist.barrier()
                pc.destroy()
            out.append({"loss": [r["lm_loss"] for r in recs],
                        "norm": [r["grad_norm"] for r in recs]})  # fmt: skip
        out.append(_mamba_greedy(dist.get_world_size()))
    return out


def _mamba_greedy(tp: int) -> list[list[int]]:
    """Greedy tokens of the example's model (random, std 0.3) built at tp: decoding carries
    each layer's conv and SSM state, x_proj summed over tp at each token too."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config.load import load_config
    from nanotron_train.inference.decoding import generate
    from nanotron_train.model_factory import build_family_stage

    cfg = load_config(HERE / "config_mamba.yaml", _mamba_layout_overrides({}))
    pc = ParallelContext(tp=tp)
    try:
        stage = build_family_stage(cfg.model.model_config, pc, 32, seed=3, init_std=0.3)
        return generate(stage, [[5, 9, 11, 3, 17], [7, 21]], max_new_tokens=5).tokens
    finally:
        pc.destroy()


def test_nanotron_mamba_example_layouts_equal_one_process():
    """The example in float32 at tp=2 (Nanotron's example is wrong there: it does not sum
    x_proj's partial products over tp), sequence parallel and pp=2 with recompute, in one
    world-2 launch: each step's loss and grad norm equal one process's (1e-5), and greedy
    generation at tp=2 is token for token one process's."""
    from nanotron_parallel.testing import run_distributed

    ref, one_process_tokens = _mamba_curves([{}])
    *results, tokens = run_distributed(_mamba_curves, 2, LAYOUTS, timeout=300)[0]
    assert tokens == one_process_tokens  # greedy decoding at tp=2
    assert len(ref["loss"]) == 2 and all(math.isfinite(x) for x in ref["loss"])
    for layout, res in zip(LAYOUTS, results, strict=True):
        for key in ("loss", "norm"):
            for a, b in zip(res[key], ref[key], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (layout, key, res[key], ref[key])
