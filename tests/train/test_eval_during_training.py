"""Harness tasks on a run's checkpoints while it trains (the `evaluation` section, Nanotron's
`lighteval` read as one): the in-process evaluation at each checkpoint gives the scores
`python -m nanotron_train.evaluate --tasks` gives on that checkpoint, in the metrics file;
the training steps are bitwise those of a run without evaluation; a failing task is one
warning line and an event while training goes on; the separate job (`evaluate --watch`)
picks up a checkpoint that appears while it watches. A tiny Llama on synthetic tokens, a
tokenizer built here, two task YAMLs over local files (a few examples each).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from nanotron_train.config import ConfigError, config_from_dict
from tests.train.lm_eval_tasks import mc_yaml, offline_workspace, ppl_yaml, task_yaml

pytest.importorskip("lm_eval")

VOCAB = 300


def _beams_yaml(data: Path) -> str:
    """A generation task asking for beam search, which the adapter refuses: an exception inside
    the harness's run."""
    fields = (
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: "{{label}}"\n'
        "generation_kwargs:\n"
        '  until: ["\\n"]\n'
        "  num_beams: 2\n"
    )
    return task_yaml("dt_beams", data / "mc.jsonl", "generate_until", fields, ["exact_match"])


def _tasks(root: Path) -> Path:
    from nanotron_train.data.testing import tiny_texts

    data, tasks = root / "data", root / "tasks"
    data.mkdir()
    tasks.mkdir()
    words = " ".join(tiny_texts(10, seed=3)).split()
    mc = [{"question": " ".join(words[i : i + 4]), "choices": words[i + 4 : i + 8], "label": i % 4}
          for i in range(0, 48, 8)]  # fmt: skip
    ppl = [{"text": t} for t in tiny_texts(3, seed=4, words=20)]
    (data / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (data / "ppl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ppl))
    (tasks / "dt_mc.yaml").write_text(mc_yaml("dt_mc", data))
    (tasks / "dt_ppl.yaml").write_text(ppl_yaml("dt_ppl", data, ["word_perplexity"]))
    (tasks / "dt_beams.yaml").write_text(_beams_yaml(data))
    return tasks


def _config(root: Path, name: str, tok: Path, evaluation: dict | None) -> dict:
    from tests.train.test_checkpoint import tiny_config

    raw = tiny_config({"dp": 1, "tp": 1, "pp": 1}, str(root / name / "ck"), steps=4)
    raw["checkpoints"]["checkpoint_interval"] = 2
    raw["model"]["model_config"]["vocab_size"] = VOCAB
    raw["tokenizer"] = {"tokenizer_name_or_path": str(tok)}
    raw["logging"]["metrics_file"] = str(root / name / "metrics.jsonl")
    if evaluation is not None:
        raw["evaluation"] = evaluation
    return raw


def _train(raw: dict) -> tuple[list[float], str, str]:
    """(every step's loss, stdout, stderr) of a run of `raw`."""
    import contextlib

    from nanotron_train.trainer import train

    losses: list[float] = []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        train(config_from_dict(raw, "test.yaml"), stream=out,
              on_record=lambda r: losses.append(r["lm_loss"]), every_step=True)  # fmt: skip
    return losses, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root, tok = offline_workspace(tmp_path_factory, "evaltrain", 40, VOCAB)
    tasks = _tasks(root)
    ev = {"tasks": ["dt_mc", "dt_ppl"], "include_path": [str(tasks)], "bootstrap_iters": 0}
    out = {"root": root, "tasks": tasks}
    out["with"] = _train(_config(root, "with", tok, ev))
    out["without"] = _train(_config(root, "without", tok, None))
    from nanotron_train.telemetry.events import EventReporter

    events, emit = [], EventReporter.emit
    with pytest.MonkeyPatch.context() as mp:  # the events rank 0 sends to the dashboard
        mp.setattr(
            EventReporter, "emit", lambda self, *a, **k: (events.append(a), emit(self, *a, **k))
        )
        out["failing"] = _train(_config(root, "failing", tok, {**ev, "tasks": ["dt_beams"]}))
    out["events"] = events
    return out


def _records(root: Path, name: str) -> list[dict]:
    lines = (root / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _scores(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k.startswith("eval/") and k != "eval/seconds"}


def test_scores_at_each_checkpoint_equal_the_evaluate_command(runs, capsys):
    from nanotron_train.evaluate import main

    root = runs["root"]
    evals = [r for r in _records(root, "with") if "eval/seconds" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert [r["consumed_tokens"] for r in evals] == [2 * 4 * 16, 4 * 4 * 16]
    for rec in evals:
        capsys.readouterr()
        args = ["--ckpt-path", str(root / "with" / "ck" / str(rec["step"])), "--json",
                "--tasks", "dt_mc,dt_ppl", "--include-path", str(runs["tasks"]),
                "--bootstrap-iters", "0"]  # fmt: skip
        assert main(args) == 0
        tasks = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]
        expected = {"eval/dt_mc/acc": tasks["dt_mc"]["acc,none"],
                    "eval/dt_mc/acc_norm": tasks["dt_mc"]["acc_norm,none"],
                    "eval/dt_ppl/word_perplexity": tasks["dt_ppl"]["word_perplexity,none"]}  # fmt: skip
        assert _scores(rec) == expected
    # the model learnt between the checkpoints: the scores are of each checkpoint's weights
    assert evals[0]["eval/dt_ppl/word_perplexity"] != evals[1]["eval/dt_ppl/word_perplexity"]
    assert "evaluation of checkpoint step 4 | dt_mc/acc: " in runs["with"][1]


def test_training_steps_bitwise_equal_with_and_without_evaluation(runs):
    with_eval, without, failing = runs["with"][0], runs["without"][0], runs["failing"][0]
    assert len(with_eval) == 4
    assert with_eval == without  # bitwise: floats compared exactly
    assert failing == without


def test_failing_task_is_one_line_and_training_goes_on(runs):
    losses, _, err = runs["failing"]
    lines = [line for line in err.splitlines() if "evaluation of checkpoint" in line]
    ck = runs["root"] / "failing" / "ck"
    assert lines == [
        f"warning: step {s}: evaluation of checkpoint {ck / str(s)} failed: HarnessError: "
        "generation_kwargs ['num_beams']: not supported by the nanotron model (it honours "
        "['do_sample', 'max_gen_toks', 'seed', 'temperature', 'top_k', 'top_p', 'until']); "
        "training continues"
        for s in (2, 4)
    ]
    assert [(e[0], e[1], e[3]) for e in runs["events"]] == [
        ("evaluation_failed", "warning", 2),
        ("evaluation_failed", "warning", 4),
    ]
    assert [e[2] for e in runs["events"]] == [line.split(": ", 2)[2] for line in lines]
    records = _records(runs["root"], "failing")
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # every step trained and logged
    assert not any(k.startswith("eval/") for r in records for k in r)


class RecordingClient:
    """Stands for the dashboard client the watcher opens for the run (its id, its URL)."""

    def __init__(self, run_id: str) -> None:
        self.run_id, self.sent = run_id, []

    def metrics(self, step: int, values: dict) -> None:
        self.sent.append((step, values))

    def event(self, *args) -> None:
        self.sent.append(("event", args))

    def close(self, timeout: float = 5.0) -> None:
        self.sent.append("closed")


def test_separate_job_picks_up_a_new_checkpoint(runs, tmp_path, monkeypatch):
    """`evaluate --watch` on a folder holding step 2 evaluates it, then step 4 once it appears
    (the run's last step: the watcher stops), with the in-process evaluation's scores, in its
    results file and to the dashboard as the run's metrics."""
    from nanotron_train.evaluate import main
    from nanotron_train.reporting import dashboard_sink

    clients: list[RecordingClient] = []
    monkeypatch.setattr(
        dashboard_sink,
        "client_from_config",
        lambda url, run_id, **kw: clients.append(RecordingClient(run_id)) or clients[-1],
    )

    src, root = runs["root"] / "with" / "ck", tmp_path / "ck"
    root.mkdir()
    shutil.copytree(src / "2", root / "2")
    results = tmp_path / "scores.jsonl"
    status: list[int] = []
    args = [
        "--watch",
        str(root),
        "--poll-s",
        "0.1",
        "--metrics-file",
        str(results),
        "--idle-timeout-s",
        "120",
    ]  # the tasks: the checkpoints' own evaluation section
    thread = threading.Thread(target=lambda: status.append(main(args)))
    thread.start()
    deadline = time.monotonic() + 120
    while not results.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    shutil.copytree(src / "4", tmp_path / "incoming")
    (tmp_path / "incoming").rename(root / "4")  # a save appears whole, as the trainer's rename
    thread.join(timeout=180)
    assert status == [0]
    watched = [json.loads(line) for line in results.read_text().splitlines()]
    in_process = [r for r in _records(runs["root"], "with") if "eval/seconds" in r]
    assert [r["step"] for r in watched] == [2, 4]
    assert [_scores(r) for r in watched] == [_scores(r) for r in in_process]
    run_id = _records(runs["root"], "with")[0]["run_id"]
    assert {r["run_id"] for r in watched} == {run_id}
    [client] = clients
    assert client.run_id == run_id
    assert client.sent == [
        (r["step"], {**_scores(r), "eval/seconds": w["eval/seconds"],
                     "consumed_tokens": r["consumed_tokens"]})
        for r, w in zip(in_process, watched)
    ] + ["closed"]  # fmt: skip


def test_lighteval_section_is_read_and_what_does_not_map_is_warned(tmp_path):
    from nanotron_train.config.evaluation import evaluation_of, evaluation_warnings

    raw = _config(tmp_path, "l", tmp_path / "tok", None)
    raw["lighteval"] = {"eval_interval": 4, "batch_size": 8, "s3_save_path": "s3://b/evals",
                        "parallelism": {"dp": 1, "tp": 1, "pp": 2},
                        "tasks": {"tasks": "lighteval|hellaswag|0|1,leaderboard|arc_easy|0|1",
                                  "max_samples": 10, "dataset_loading_processes": 8}}  # fmt: skip
    cfg = config_from_dict(raw, "l.yaml")
    ev = evaluation_of(cfg)
    assert (ev.tasks, ev.num_fewshot, ev.limit, ev.batch_size, ev.interval, ev.mode, ev.pp) == (
        ["hellaswag", "arc_easy"],
        0,
        10.0,
        8,
        4,
        "separate",
        2,
    )
    assert evaluation_warnings(cfg) == [
        "lighteval keys s3_save_path have no meaning here and are ignored (the checkpoints are "
        "evaluated by `python -m nanotron_train.evaluate --watch`)"
    ]
    from nanotron_train.config.training_inputs import prepare_for_training

    said: list[str] = []
    prepare_for_training(cfg, "l.yaml", warn=said.append)  # what the trainer's rank 0 prints
    assert said == [f"warning: l.yaml: {line}" for line in evaluation_warnings(cfg)]


def test_missing_task_folder_is_one_line_naming_the_key(tmp_path):
    from nanotron_train.config.training_inputs import prepare_for_training

    missing = tmp_path / "nope"
    ev = {"tasks": ["x"], "include_path": [str(missing)]}
    cfg = config_from_dict(_config(tmp_path, "f", tmp_path / "tok", ev), "f.yaml")
    with pytest.raises(ConfigError) as err:
        prepare_for_training(cfg, "f.yaml")
    assert str(err.value) == (
        f"f.yaml: evaluation.include_path.0: {missing}: no such folder of task YAMLs, seen "
        f"from {os.getcwd()}"
    )


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        ({"tasks": []}, "evaluation.tasks"),
        ({"interval": 3}, "evaluation.interval"),
        ({"limit": 0}, "evaluation.limit"),
    ],
)
def test_evaluation_section_errors_name_the_key(tmp_path, patch, key):
    raw = _config(tmp_path, "e", tmp_path / "tok", {"tasks": ["x"], **patch})
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "e.yaml")
    assert str(err.value).startswith(f"e.yaml: {key}: ")
