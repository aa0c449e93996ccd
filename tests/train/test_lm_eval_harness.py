"""lm-evaluation-harness on checkpoints of ours: `python -m nanotron_train.evaluate --tasks`
through our model adapter gives the harness's own scores for the same weights exported to
transformers (`HFLM`): identical accuracies and generations, log-likelihoods within 1e-4.

Three random models built locally in transformers (Llama, Qwen2, Qwen2-MoE) go through
`convert from-hf` (our checkpoint) and `convert to-hf` (the export HFLM loads). Three task
YAMLs over local JSONL files, one per request kind: multiple choice (loglikelihood),
perplexity (loglikelihood_rolling, texts longer than the model's 64 positions, so several
windows) and generation with stop sequences (generate_until). Then the same at tp=2 and pp=2
(two gloo processes). Nothing is downloaded (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from nanotron_parallel.testing import run_distributed
from tests.train.lm_eval_tasks import mc_yaml, offline_workspace, ppl_yaml, task_yaml

pytest.importorskip("lm_eval")

VOCAB = 300
FAMILIES = ("llama", "qwen2", "qwen2_moe")
TASKS = "nt_mc,nt_ppl,nt_gen,nt_gen_nostop"
STOPS = ["s", "\n"]
PPL_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


def _gen_yaml(task: str, data: Path, stops: list[str]) -> str:
    """Generation (generate_until requests) over data/gen.jsonl, stopping at `stops` or EOS."""
    fields = (
        'doc_to_text: "{{question}} ="\n'
        'doc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n"
        f"  until: {json.dumps(stops)}\n"
        "  max_gen_toks: 8\n"
        "  do_sample: false\n"
    )
    return task_yaml(task, data / "gen.jsonl", "generate_until", fields, ["exact_match"])


def _write_tasks(root: Path) -> Path:
    from nanotron_train.data.testing import tiny_texts

    rng = random.Random(0)
    words = " ".join(tiny_texts(20, seed=3)).split()
    data, tasks = root / "data", root / "tasks"
    data.mkdir()
    tasks.mkdir()

    def phrase(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    mc = [
        {"question": phrase(rng.randint(3, 8)), "choices": [phrase(rng.randint(1, 3)) for _ in range(4)],
         "label": rng.randint(0, 3)}
        for _ in range(12)
    ]  # fmt: skip
    ppl = [{"text": t} for t in tiny_texts(5, seed=4, words=90)]
    gen = [{"question": phrase(rng.randint(2, 6)), "answer": phrase(1)} for _ in range(8)]
    for name, rows in (("mc", mc), ("ppl", ppl), ("gen", gen)):
        (data / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tasks / "nt_mc.yaml").write_text(mc_yaml("nt_mc", data))
    (tasks / "nt_ppl.yaml").write_text(ppl_yaml("nt_ppl", data, PPL_METRICS))
    (tasks / "nt_gen.yaml").write_text(_gen_yaml("nt_gen", data, STOPS))
    (tasks / "nt_gen_nostop.yaml").write_text(_gen_yaml("nt_gen_nostop", data, []))  # EOS only
    return tasks


def _our_config(kind: str):
    from nanotron_models import LlamaConfig, Qwen2Config
    from nanotron_models.moe import MoEConfig

    sizes = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=kind == "llama",
    )  # fmt: skip
    if kind == "llama":
        return LlamaConfig(**sizes)
    moe = None
    if kind == "qwen2_moe":
        moe = MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=32, layers=[1],
                        shared_expert_intermediate_size=48, enable_shared_expert=True)  # fmt: skip
    return Qwen2Config(**sizes, attention_bias=True, moe_config=moe)


def _random_hf_folder(kind: str, tok: Path, out: Path) -> Path:
    """A transformers model of the family with random weights (large enough that the next
    token is clear), saved with the tokenizer's files."""
    import transformers

    from nanotron_models.families import family_of
    from nanotron_train.interop.hf_folder import copy_tokenizer_files

    config = _our_config(kind)
    hf_config = family_of(config).hf.config_to_hf(config)
    torch.manual_seed(FAMILIES.index(kind))
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out)
    copy_tokenizer_files(tok, out)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """The tokenizer, the tasks, and per family our checkpoint and its transformers export."""
    from nanotron_train.convert import main as convert_main

    root, tok = offline_workspace(tmp_path_factory, "harness", 60, VOCAB)
    models = {}
    for kind in FAMILIES:
        hf = _random_hf_folder(kind, tok, root / f"{kind}-hf")
        ckpt, export = root / f"{kind}-ckpt", root / f"{kind}-export"
        assert convert_main(["from-hf", "--hf-path", str(hf), "--out", str(ckpt)]) == 0
        assert convert_main(["to-hf", "--ckpt-path", str(ckpt), "--out", str(export)]) == 0
        models[kind] = {"ckpt": ckpt, "export": export}
    return {"root": root, "tasks": _write_tasks(root), "models": models}


def _ours(ckpt: Path, tasks: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--ckpt-path", str(ckpt), "--tasks", TASKS, "--include-path", str(tasks),
        "--batch-size", "5", "--bootstrap-iters", "0", "--log-samples",
        "--output-path", str(out), *extra,
    ]  # fmt: skip


def _hflm_results(export: Path, tasks: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(export), device="cpu", batch_size=3, dtype="float32")
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return simple_evaluate(
        model=lm, tasks=TASKS.split(","), task_manager=manager, bootstrap_iters=0,
        log_samples=True,
    )  # fmt: skip


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def assert_same_scores(ours: dict, theirs: dict) -> None:
    """Identical accuracies, exact matches and generations; log-likelihoods within 1e-4."""
    for task in ("nt_mc", "nt_ppl", "nt_gen", "nt_gen_nostop"):
        a, b = _responses(ours, task), _responses(theirs, task)
        assert len(a) == len(b) > 0
        for mine, hf in zip(a, b):
            if task.startswith("nt_gen"):
                assert mine == hf
                continue
            flat_a, flat_b = [r[0] for r in mine], [r[0] for r in hf]
            if task == "nt_mc":  # (log-likelihood, greedy) per choice
                assert [g for _, g in flat_a] == [g for _, g in flat_b]
                flat_a, flat_b = [x for x, _ in flat_a], [x for x, _ in flat_b]
            assert flat_a == pytest.approx(flat_b, abs=1e-4)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["nt_mc"][metric] == theirs["results"]["nt_mc"][metric]
    assert (
        ours["results"]["nt_gen"]["exact_match,none"]
        == theirs["results"]["nt_gen"]["exact_match,none"]
    )
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["nt_ppl"][metric] == pytest.approx(
            theirs["results"]["nt_ppl"][metric], rel=1e-5
        )


@pytest.fixture(scope="module")
def single(setup) -> dict:
    """Per family: our command's results (one process) and HFLM's on the export."""
    from nanotron_train.evaluate import main

    out = {}
    for kind, paths in setup["models"].items():
        path = setup["root"] / f"{kind}-ours.json"
        assert main(_ours(paths["ckpt"], setup["tasks"], path, "--json")) == 0
        out[kind] = {
            "ours": json.loads(path.read_text()),
            "hflm": _hflm_results(paths["export"], setup["tasks"]),
        }
    return out


@pytest.mark.parametrize("kind", FAMILIES)
def test_adapter_scores_equal_hflm_on_the_exported_weights(setup, single, kind):
    from nanotron_train.data import load_tokenizer

    ours, theirs = single[kind]["ours"], single[kind]["hflm"]
    assert_same_scores(ours, theirs)
    # Perplexity texts longer than the model's 64 positions: several rolling windows.
    tok = load_tokenizer(str(setup["root"] / "tok"))
    lengths = [len(tok.encode(s["doc"]["text"])) for s in ours["samples"]["nt_ppl"]]
    assert max(lengths) > 2 * 64
    # Each stopped generation is the unstopped one cut before its first stop sequence, and
    # some stops cut a non-empty text short.
    stopped, full = _responses(ours, "nt_gen"), _responses(ours, "nt_gen_nostop")
    cut = 0
    for [[text]], [[whole]] in zip(stopped, full):
        expected = whole
        for stop in STOPS:
            expected = expected.split(stop)[0]
        assert text == expected
        cut += 0 < len(text) < len(whole)
    assert cut >= 2


def test_command_prints_scores_and_refuses_bad_input(setup, single, capsys):
    from nanotron_train.evaluate import main

    paths = setup["models"]["llama"]
    capsys.readouterr()
    args = ["--ckpt-path", str(paths["ckpt"]), "--include-path", str(setup["tasks"])]
    assert main([*args, "--tasks", "nt_mc", "--bootstrap-iters", "0"]) == 0
    acc = single["llama"]["hflm"]["results"]["nt_mc"]["acc,none"]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == (f"checkpoint: {paths['ckpt'] / '0'} (step 0) | task nt_mc | "
                    f"acc,none: {acc:.6g} | acc_norm,none: "
                    f"{single['llama']['hflm']['results']['nt_mc']['acc_norm,none']:.6g} "
                    "(tp=1, pp=1)")  # fmt: skip
    missing = setup["root"] / "no-such-folder"
    assert (
        main(["--ckpt-path", str(paths["ckpt"]), "--tasks", "x", "--include-path", str(missing)])
        == 2
    )
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --include-path {missing}: not a folder"
    ]
    assert main(["--ckpt-path", str(paths["ckpt"])]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: nothing to evaluate: give --dataset-folder DIR and/or --tasks a,b"
    ]


def _layout_job(runs: list[tuple[list[str], list[str]]], trainings: list[dict]) -> None:
    """On each of 2 ranks: every family's tasks at tp=2, then at pp=2; then short trainings
    that evaluate their checkpoints in process (evaluation section) at their layouts."""
    import io

    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.config import config_from_dict
    from nanotron_train.evaluate import main
    from nanotron_train.trainer import Trainer

    with shared_default_group():
        for tp2, pp2 in runs:
            assert main(tp2) == 0
            assert main([*pp2, "--pp", "2"]) == 0
        for raw in trainings:
            par = raw["parallelism"]
            pc = ParallelContext(dp=par["dp"], tp=par["tp"], pp=par["pp"])
            try:
                Trainer(config_from_dict(raw, "t.yaml"), pc, stream=io.StringIO()).train()
            finally:
                dist.barrier()
                pc.destroy()


def _evaluating_run(setup, layout: dict, name: str) -> dict:
    """A 2-step run of a tiny Llama (the harness tests' tokenizer) whose checkpoint of step 2
    is evaluated in process on nt_mc and nt_ppl."""
    from tests.train.test_checkpoint import tiny_config

    root = setup["root"] / name
    raw = tiny_config(layout, str(root / "ck"), steps=2)
    raw["model"]["model_config"].update(vocab_size=VOCAB, max_position_embeddings=64)
    raw["checkpoints"]["checkpoint_interval"] = 2
    raw["tokenizer"] = {"tokenizer_name_or_path": str(setup["root"] / "tok")}
    raw["logging"]["metrics_file"] = str(root / "metrics.jsonl")
    raw["evaluation"] = {"tasks": ["nt_mc", "nt_ppl"], "include_path": [str(setup["tasks"])],
                         "bootstrap_iters": 0}  # fmt: skip
    return raw


def test_tp2_and_pp2_scores_equal_hflm_and_training_evaluates_at_its_layout(setup, single, capsys):
    runs, outs = [], []
    for kind, paths in setup["models"].items():
        tp2, pp2 = (setup["root"] / f"{kind}-{layout}.json" for layout in ("tp2", "pp2"))
        runs.append(
            (_ours(paths["ckpt"], setup["tasks"], tp2), _ours(paths["ckpt"], setup["tasks"], pp2))
        )
        outs += [(kind, tp2, (2, 1)), (kind, pp2, (1, 2))]
    layouts = {"train-pp2": {"dp": 1, "tp": 1, "pp": 2}, "train-dp2": {"dp": 2, "tp": 1, "pp": 1}}
    trainings = [_evaluating_run(setup, lay, name) for name, lay in layouts.items()]
    run_distributed(_layout_job, 2, runs, trainings, timeout=300)
    for kind, path, layout in outs:
        ours = json.loads(path.read_text())
        assert (ours["nanotron"]["tp"], ours["nanotron"]["pp"]) == layout
        assert_same_scores(ours, single[kind]["hflm"])
    # In-process evaluation during training, all ranks taking part at the run's layout (pp2:
    # the pipelined adapter; dp2: both replicas), equals one process's `evaluate --tasks` on
    # the checkpoint the run saved.
    from nanotron_train.evaluate import main

    for name in layouts:
        lines = (setup["root"] / name / "metrics.jsonl").read_text().splitlines()
        [rec] = [r for r in map(json.loads, lines) if "eval/seconds" in r]
        capsys.readouterr()
        ckpt = setup["root"] / name / "ck" / "2"
        assert main(["--ckpt-path", str(ckpt), "--tasks", "nt_mc,nt_ppl", "--include-path",
                     str(setup["tasks"]), "--bootstrap-iters", "0", "--json"]) == 0  # fmt: skip
        tasks = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]
        assert rec["step"] == 2
        assert rec["eval/nt_mc/acc"] == tasks["nt_mc"]["acc,none"]
        assert rec["eval/nt_mc/acc_norm"] == tasks["nt_mc"]["acc_norm,none"]
        for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
            assert rec[f"eval/nt_ppl/{metric}"] == pytest.approx(
                tasks["nt_ppl"][f"{metric},none"], rel=1e-5
            )
