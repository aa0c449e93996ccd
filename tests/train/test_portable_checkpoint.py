"""A checkpoint works from any folder, and a training config's inputs are checked up front.

One tiny run through the command (`python -m nanotron_train`, in-process) names its tokenizer
and data with paths relative to its folder. Then, from another folder: the checkpoint's config
holds absolute paths, `generate` and `convert to-hf` work with the checkpoint's absolute path,
`--tokenizer` replaces a tokenizer that moved, and to-hf writes the config's token ids.
Resuming the final checkpoint says that tokens.train_steps is reached and how to go on.
Before any worker: a missing dataset folder is one line naming the key and the config file, and
a token id that is not a special token of the tokenizer one warning (training goes on).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_train.__main__ import main as train_main


def _config() -> dict:
    return {
        "general": {"project": "t", "run": "portable", "seed": 1},
        "model": {
            "model_config": {
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
                "max_position_embeddings": 32, "tie_word_embeddings": True,
                "bos_token_id": 0, "eos_token_id": 0,  # <|endoftext|> in the test BPE
            },
            "init_method": {"std": 0.05},
            "make_vocab_size_divisible_by": 4,
            "dtype": "float32",
        },
        "tokenizer": {"tokenizer_name_or_path": "tok"},  # relative to the run's folder
        "tokens": {
            "sequence_length": 16, "micro_batch_size": 2,
            "batch_accumulation_per_replica": 1, "train_steps": 2,
        },
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 1}},
        "checkpoints": {"checkpoints_path": "ckpt", "checkpoint_interval": 2},
        "data_stages": [
            {"name": "s", "start_training_step": 1,
             "data": {"dataset": {"dataset_folder": "ns"}, "seed": 2, "num_loading_workers": 0}},
        ],
        "logging": {"iteration_step_info_interval": 1},
    }  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Tokenizer, Nanoset and a 2-step run, all named relative to the run's folder."""
    from nanotron_train.data import tokenize_to_nanoset
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("portable")
    make_tokenizer(root / "tok", tiny_texts(60), vocab_size=300)
    docs = root / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in tiny_texts(80, seed=1)))
    tokenize_to_nanoset([str(docs)], str(root / "tok"), root / "ns", progress=False, num_workers=1)
    (root / "cfg.yaml").write_text(yaml.safe_dump(_config()))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert train_main(["--config-file", "cfg.yaml"]) == 0
    assert (root / "ckpt" / "2" / "checkpoint_metadata.json").is_file()
    return root


def test_checkpoint_config_holds_absolute_paths_and_works_from_another_folder(
    run_dir, tmp_path, monkeypatch, capsys
):
    from nanotron_train.convert import main as convert_main
    from nanotron_train.generate import main as generate_main

    stored = yaml.safe_load((run_dir / "ckpt" / "2" / "config.yaml").read_text())
    assert stored["tokenizer"]["tokenizer_name_or_path"] == str(run_dir / "tok")
    dataset = stored["data_stages"][0]["data"]["dataset"]
    assert dataset["dataset_folder"] == [str(run_dir / "ns")]
    monkeypatch.chdir(tmp_path)  # elsewhere: no tok/ or ns/ here
    capsys.readouterr()
    ckpt = str(run_dir / "ckpt")
    out_json = tmp_path / "gen.json"
    args = ["--ckpt-path", ckpt, "--prompt", "def", "--max-new-tokens", "4"]
    assert generate_main([*args, "--output-json", str(out_json)]) == 0
    assert len(json.loads(out_json.read_text())["results"][0]["new_ids"]) >= 1
    assert convert_main(["to-hf", "--ckpt-path", ckpt, "--out", "hf"]) == 0
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (0, 0)  # the config's ids
    assert "note:" not in capsys.readouterr().err  # they are the tokenizer's: nothing to say


def test_tokenizer_option_replaces_a_tokenizer_that_moved(run_dir, tmp_path, capsys):
    from nanotron_train.convert import main as convert_main
    from nanotron_train.evaluate import main as evaluate_main
    from nanotron_train.generate import main as generate_main

    ckpt, moved = str(run_dir / "ckpt"), tmp_path / "tok-moved"
    (run_dir / "tok").rename(moved)  # the checkpoint's config names run_dir/tok
    try:
        gen = ["--ckpt-path", ckpt, "--prompt", "def", "--max-new-tokens", "3"]
        capsys.readouterr()
        assert generate_main(gen) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(run_dir / "tok") in err and "--tokenizer" in err
        assert generate_main([*gen, "--tokenizer", str(moved)]) == 0
        to_hf = ["to-hf", "--ckpt-path", ckpt, "--out", str(tmp_path / "hf")]
        assert convert_main(to_hf) == 2
        assert convert_main([*to_hf, "--tokenizer", str(moved)]) == 0
        exported = (tmp_path / "hf" / "tokenizer.json").read_bytes()
        assert exported == (moved / "tokenizer.json").read_bytes()
        capsys.readouterr()
        ev = ["--ckpt-path", ckpt, "--dataset-folder", str(run_dir / "ns"), "--json"]
        assert evaluate_main([*ev, "--tokenizer", str(moved)]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["tokens"] > 0 and report["val_loss"] > 0
    finally:
        moved.rename(run_dir / "tok")


def test_resuming_the_final_checkpoint_says_how_to_go_on(run_dir, monkeypatch, capsys):
    monkeypatch.chdir(run_dir)
    capsys.readouterr()
    assert train_main(["--config-file", "cfg.yaml", "--resume", "latest"]) == 0
    out = capsys.readouterr().out
    assert "resumed from ckpt/2 at step 2" in out
    assert (
        "tokens.train_steps=2 is reached: nothing to train. To train on, resume with "
        "--override tokens.train_steps=N (N > 2)" in out
    )
    assert "iteration:" not in out  # and indeed nothing was trained


def test_missing_dataset_folder_is_named_by_key_before_any_worker(run_dir, monkeypatch, capsys):
    import torch.distributed.run

    from nanotron_train.launch import main as launch_main

    def no_workers(args):
        raise AssertionError("torchrun started although the config names a missing folder")

    monkeypatch.setattr(torch.distributed.run, "run", no_workers)
    monkeypatch.chdir(run_dir)
    capsys.readouterr()
    override = "data_stages.0.data.dataset.dataset_folder=missing"
    argv = ["--nproc_per_node=1", "--config-file", "cfg.yaml", "--override", override]
    assert launch_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: cfg.yaml (with --override): data_stages.0.data.dataset.dataset_folder: "
        "missing: no such folder"
    )
    assert err.count("\n") == 1


def test_token_ids_that_are_not_special_tokens_train_with_one_warning(run_dir, monkeypatch, capsys):
    """Nanotron's bos_token_id 1 (`'!'` in this BPE) trains, with one warning from one process
    naming the key and what export and generation use instead; an id left out means the
    tokenizer's: no warning."""
    import torch.distributed.run

    from nanotron_train.__main__ import QUIET_ENV, _warner
    from nanotron_train.config import config_from_dict
    from nanotron_train.config.token_ids import generation_eos, ids_for_export
    from nanotron_train.data import load_tokenizer
    from nanotron_train.launch import main as launch_main

    monkeypatch.chdir(run_dir)
    capsys.readouterr()
    argv = ["--config-file", "cfg.yaml", "--override", "checkpoints.checkpoints_path=null",
            "--override", "model.model_config.bos_token_id=1"]  # fmt: skip
    assert train_main(argv) == 0
    expected = (
        "warning: cfg.yaml (with --override): model.model_config.bos_token_id=1 ('!') is not a "
        f"special token of the tokenizer {run_dir / 'tok' / 'tokenizer.json'} (its special "
        "tokens: <|endoftext|>=0): training goes on, but export and generation use "
        "bos_token_id=0 (<|endoftext|>) instead; set it to a special token, or null for the "
        "tokenizer's"
    )
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "warning" in line] == [expected]
    assert "iteration: 2 / 2" in captured.out
    # nanotron_train.launch prints it before starting the workers, which stay quiet
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: None)
    monkeypatch.delenv(QUIET_ENV, raising=False)  # launch sets it: unset again after the test
    assert launch_main(["--nproc_per_node=1", *argv]) == 0
    assert capsys.readouterr().err == expected + "\n"
    monkeypatch.delenv(QUIET_ENV)
    assert _warner(0) is not None and _warner(1) is None  # under torchrun: rank 0's
    monkeypatch.setenv(QUIET_ENV, "1")
    assert _warner(0) is None
    # left out: the tokenizer's, for training, export and generation alike
    raw = yaml.safe_load((run_dir / "cfg.yaml").read_text())
    for key in ("bos_token_id", "eos_token_id"):
        del raw["model"]["model_config"][key]
    mc = config_from_dict(raw).model.model_config
    tok = load_tokenizer(str(run_dir / "tok"))
    assert (mc.bos_token_id, mc.eos_token_id) == (None, None)
    assert ids_for_export(mc, tok) == ({"bos_token_id": 0, "eos_token_id": 0,
                                        "pad_token_id": None}, [])  # fmt: skip
    assert generation_eos(mc, tok) == 0
    (run_dir / "cfg-no-ids.yaml").write_text(yaml.safe_dump(raw))
    assert train_main(["--config-file", "cfg-no-ids.yaml", "--override",
                       "checkpoints.checkpoints_path=null"]) == 0  # fmt: skip
    assert "warning" not in capsys.readouterr().err


def test_generation_stops_at_the_eos_the_export_writes(run_dir):
    """The config's eos where it is a special token (here one added beside <|endoftext|>),
    else the tokenizer's: generation (generate, samples) and export use the same id."""
    from nanotron_models import LlamaConfig
    from nanotron_train.config.token_ids import generation_eos, ids_for_export
    from nanotron_train.data import load_tokenizer

    tok = load_tokenizer(str(run_dir / "tok"))
    tok.tokenizer.add_special_tokens(["<|im_end|>"])
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    for eos, expected in ((im_end, im_end), (2, 0), (None, 0)):
        mc = LlamaConfig(vocab_size=320, eos_token_id=eos)
        assert generation_eos(mc, tok) == expected == ids_for_export(mc, tok)[0]["eos_token_id"]
    assert im_end == 300 and tok.eos_token_id == 0


def test_to_hf_replaces_an_old_checkpoints_ordinary_token_ids_with_a_note(run_dir):
    from nanotron_models import LlamaConfig
    from nanotron_train.config.token_ids import ids_for_export
    from nanotron_train.data import load_tokenizer

    tok = load_tokenizer(str(run_dir / "tok"))
    old = LlamaConfig(vocab_size=300, bos_token_id=1, eos_token_id=0, pad_token_id=5)
    ids, notes = ids_for_export(old, tok)
    assert ids == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None}
    assert [n.split(":")[1] for n in notes] == [
        " model_config.bos_token_id",
        " model_config.pad_token_id",
    ]
    assert "1 is '!'" in notes[0]


def test_quickstart_config_token_ids_are_the_corpus_tokenizers_special_token(run_dir):
    from nanotron_train.data import load_tokenizer
    from nanotron_train.data.tokenizer import EOS_TOKEN

    repo = Path(__file__).resolve().parents[2]
    mc = yaml.safe_load((repo / "configs" / "quickstart-cpu.yaml").read_text())["model"]
    ids = {k: mc["model_config"][k] for k in ("bos_token_id", "eos_token_id")}
    # The default corpus's BPE is trained as this one is (train_tokenizer): EOS is its only
    # special token, so its id is the same.
    tok = load_tokenizer(str(run_dir / "tok"))
    eos = tok.tokenizer.token_to_id(EOS_TOKEN)
    assert ids == {"bos_token_id": eos, "eos_token_id": eos} and eos == 0
