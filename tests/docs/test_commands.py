"""Every fenced shell command of README.md and docs/*.md (```bash, ```sh, ```console) runs as
written, with only the substitutions of the table below: a broken command fails CI.

Each page runs in its own copy of one prepared sandbox (a tiny corpus, tokenizer, Nanosets, a
2-step checkpoint, `run.yaml`), two pages at a time, its blocks in page order, each block as one
bash script (so `source`, `&` and `$VAR` behave as in a terminal). A dashboard started without
`&` is started, waited for until it answers, and stopped. A ```console block's `$ ` lines are
the commands and the other lines the output they must print; a shown `error:` line means exit
status 2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.docs.doc_pages import ROOT, SHELL_LANGS, Block, blocks, pages, rel

# --- THE table: what is substituted in every command, in this order, and why ------------------
PORT = "{port}"  # a free port, per page
SUBSTITUTIONS: list[tuple[str, str, str]] = [
    # (regex, replacement, why)
    (r"tokens\.train_steps=\d+", "tokens.train_steps=2", "tiny step counts"),
    (
        r"(-m nanotron_train(?:\.launch)?\s.*?)(\s*&)?$",
        r"\1 --override tokens.train_steps=2\2",
        "every training stops after 2 steps (an override of its own is replaced above)",
    ),
    (r"--max-new-tokens \d+", "--max-new-tokens 4", "short generations"),
    (r"--limit-batches \d+", "--limit-batches 1", "one evaluation batch"),
    (r"--split 0\.005", "--split 0.25", "the tiny Nanoset has few documents"),
    (r"checkpoints/1000\b|checkpoints/100\b", "checkpoints/2", "the prepared run's step"),
    (r"\.cache/data/<corpus>", ".cache/data/corpus", "the prepared corpus of the quickstart"),
    (
        r"prepare-default --cache-dir \.cache/data",
        "prepare-default --cache-dir .cache/data --source-root corpus-py --no-progress",
        "a few Python files instead of the whole standard library",
    ),
    (r"\b8008\b", PORT, "a free port for the dashboard"),
    (r"127\.0\.0\.1:29500", "127.0.0.1:{rdzv}", "a free rendezvous port"),
    (r"(?<![\w/])\.venv/", f"{ROOT}/.venv/", "the repository's environment"),
]
# Files every page finds in its working directory (made once by the `sandbox` fixture):
# configs/ and examples/ (the repository's), corpus/ (text), corpus-py/ (Python files), tok/
# (BPE, 8192), nanoset/ and nanoset-valid/ (tokenized with tok), checkpoints/
# (configs/tiny-llama-cpu.yaml on nanoset, 2 steps), run.yaml (that config at dp=2 x pp=2, 4
# processes), prompts.txt,
# .cache/data/corpus/{tokenizer,nanoset} (the quickstart's data, vocabulary 4096). A folder that
# a block writes itself (`--out DIR`) is removed from the page's copy before the block runs.

# --- commands not run here, each with its reason (regex on the command) -----------------------
EXCLUDED: list[tuple[str, str]] = [
    (r"^make run\b", "the quickstart itself: tests/e2e/test_quickstart.py checks its parts"),
    (r"^make test\b", "the whole suite: this test is part of it"),
    (r"^make stop\b", "would stop the developer's own `make run` dashboard"),
    (r"^pip install ", "installs into the environment; tests/packaging installs every package"),
    (r"^sbatch ", "needs SLURM; tests/packaging/test_slurm_example.py runs the script on one node"),
    (r"^(\S+=\S+ )+sbatch ", "needs SLURM; tests/packaging/test_slurm_example.py runs the script"),
    (r"llama-1b-gpu\.yaml", "a ~1B model on 8 GPUs or nodes: GPU only"),
    (r"NODE0_HOSTNAME", "needs several machines"),
    (
        r"nt-checkpoints|--resume ckpt$",
        "needs a Nanotron checkpoint: tests/train/test_nanotron_checkpoint_import.py converts "
        "and resumes one",
    ),
    (
        r"^\.venv/bin/python bench/|^\S+/\.venv/bin/python bench/",
        "benchmarks run for minutes; their figures are in docs/benchmarks.md",
    ),
    (r"^bash bench/gpu\.sh", "GPU benchmark"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) per command; continuation lines joined."""
    text = block.text.replace("\\\n", " ")
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if block.lang == "console":
            if line.startswith("$ "):
                out.append((line[2:].strip(), []))
            elif line.strip() and out:
                out[-1][1].append(line.strip())
        else:
            cmd = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
            if cmd and not cmd.startswith("#"):
                out.append((re.sub(r"\s+", " ", cmd), []))
    return out


def excluded(cmd: str) -> str | None:
    return next((why for pattern, why in EXCLUDED if re.search(pattern, cmd)), None)


def substituted(cmd: str, ports: dict[str, int], literal: bool = False) -> str:
    """`literal`: a command whose shown output must match (the step-count rows do not apply:
    an added --override would change that output)."""
    for pattern, replacement, why in SUBSTITUTIONS:
        if not (literal and "steps" in why):
            cmd = re.sub(pattern, replacement, cmd)
    return cmd.replace(PORT, str(ports["port"])).replace("{rdzv}", str(ports["rdzv"]))


def shell_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p) if b.lang in SHELL_LANGS]


PRELUDE = textwrap.dedent(
    """\
    trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT
    serve_check() {  # a server: started, answering within 60 s, stopped
      eval "$1 &"; local pid=$!  # the server itself (a background simple command is exec'd)
      for _ in $(seq 300); do
        if curl -s -o /dev/null "http://127.0.0.1:$2/"; then kill $pid; wait $pid; return 0; fi
        kill -0 $pid 2>/dev/null || { wait $pid; return 1; }
        sleep 0.2
      done
      kill $pid; return 1
    }
    """
)


def block_script(block: Block, ports: dict[str, int]) -> tuple[str, list[tuple[str, list[str]]]]:
    lines, ran = [PRELUDE], []
    for cmd, expected in commands(block):
        if excluded(cmd):
            continue
        real = substituted(cmd, ports, literal=bool(expected))
        is_server = re.search(r"(^|\s)nanotron-dashboard(?! delete-run)\s", real + " ")
        if is_server and not real.endswith("&"):
            real = f"serve_check {shlex_quote(real)} {ports['port']}"
        lines.append(f"echo {shlex_quote('+++ ' + cmd[:60])} >&2")
        lines.append(real if real.endswith("&") else f'{real}\necho "+++ rc=$?" >&2')
        ran.append((real, expected))
    return "\n".join(lines) + "\n", ran


def shlex_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def check_block(block: Block, cwd: Path, env: dict[str, str]) -> None:
    ports = {"port": free_port(), "rdzv": free_port()}
    script, ran = block_script(block, ports)
    if not ran:
        return
    for real, _ in ran:  # what the block writes itself is not the prepared copy
        for out in re.findall(r"--out (\S+)", real):
            shutil.rmtree(cwd / out, ignore_errors=True)
    proc = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    where = f"{rel(block.page)}:{block.line}"
    output = proc.stdout + proc.stderr
    codes = [int(c) for c in re.findall(r"^\+\+\+ rc=(-?\d+)$", proc.stderr, flags=re.M)]
    done = [c for c, _ in ran if not c.endswith("&")]
    for (cmd, expected), code in zip([r for r in ran if not r[0].endswith("&")], codes):
        want = 2 if any(e.startswith("error:") for e in expected) else 0
        assert code == want, f"{where}: exit {code} (expected {want}): {cmd}\n{output[-4000:]}"
        for line in expected:
            assert line in output, f"{where}: {cmd!r} did not print {line!r}\n{output[-3000:]}"
    assert len(codes) == len(done), f"{where}: stopped early\n{output[-4000:]}"


# The sandbox's commands, each its module's `main(argv)` in order, in one Python process: the
# same work as `python -m MODULE ARGS` each, with one interpreter start-up instead of six.
IN_ONE_PROCESS = """
import json, sys
from nanotron_train.__main__ import main as train
from nanotron_train.data.cli import main as data
from nanotron_train.process_exit import exit_process
for module, argv in json.loads(sys.argv[1]):
    status = (data if module == "nanotron_train.data" else train)(argv)
    if status:
        print(f"python -m {module} {' '.join(argv)}: exit {status}", file=sys.stderr)
        exit_process(1)
exit_process(0)
"""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """The files the pages' commands use, made once (see the table above)."""
    base = tmp_path_factory.mktemp("docs-sandbox")
    from nanotron_train.data.testing import tiny_texts

    for i, text in enumerate(tiny_texts(num_docs=60, words=200)):
        folder = base / "corpus" / f"part{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"doc{i}.txt").write_text(text)
    (base / "corpus-valid").mkdir()
    for i, text in enumerate(tiny_texts(num_docs=10, words=200, seed=1)):
        (base / "corpus-valid" / f"doc{i}.txt").write_text(text)
    (base / "corpus-py").mkdir()
    for name in ("textwrap.py", "shlex.py", "colorsys.py"):
        shutil.copy(Path(textwrap.__file__).parent / name, base / "corpus-py" / name)
    (base / "prompts.txt").write_text("def main(\nimport\n")
    (base / "configs").symlink_to(ROOT / "configs")
    (base / "examples").symlink_to(ROOT / "examples")  # examples/sft/make_tiny_hf_llama.py
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama-cpu.yaml").read_text())
    cfg["parallelism"].update(dp=2, pp=2)
    cfg["model"]["model_config"].update(vocab_size=8192, bos_token_id=0, eos_token_id=0)
    cfg["tokenizer"]["tokenizer_name_or_path"] = "tok"
    cfg["data_stages"][0]["data"]["dataset"] = {"dataset_folder": "nanoset"}
    (base / "run.yaml").write_text(yaml.safe_dump(cfg))
    data = "nanotron_train.data"
    steps = [
        (data, ["train-tokenizer", "--input", "corpus/", "--vocab-size", "8192", "--out", "tok"]),
        (data, ["tokenize", "--input", "corpus/", "--tokenizer", "tok", "--out", "nanoset",
                "--no-progress"]),
        (data, ["tokenize", "--input", "corpus-valid/", "--tokenizer", "tok", "--out",
                "nanoset-valid", "--no-progress"]),
        ("nanotron_train", ["--config-file", "run.yaml", "--override", "parallelism.pp=1",
                            "--override", "parallelism.dp=1", "--override", "tokens.train_steps=2"]),
        (data, ["train-tokenizer", "--input", "corpus/", "--vocab-size", "4096", "--out",
                ".cache/data/corpus/tokenizer"]),
        (data, ["tokenize", "--input", "corpus/", "--tokenizer", ".cache/data/corpus/tokenizer",
                "--out", ".cache/data/corpus/nanoset", "--no-progress"]),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", IN_ONE_PROCESS, json.dumps(steps)],
        cwd=base, env=page_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (base / "checkpoints" / "2" / "checkpoint_metadata.json").is_file()
    return base


def page_env() -> dict[str, str]:
    venv_bin = str(ROOT / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANOTRON_", "TORCHELASTIC"))}
    return {**env, "PATH": f"{venv_bin}{os.pathsep}{env['PATH']}", "OMP_NUM_THREADS": "1"}


PAGES = [p for p in pages() if any(b.lang in SHELL_LANGS for b in blocks(p))]


# Pages run two at a time, each in its own copy of the sandbox with its own ports, its blocks in
# order: many commands are one process on one core (tokenize, convert, generate, a dashboard
# answering), and the suite's machines have two cores.
CONCURRENT_PAGES = 2


def run_page(page: Path, sandbox: Path, cwd: Path) -> None:
    """Every block of the page in order; the first failing command raises."""
    shutil.copytree(sandbox, cwd, symlinks=True)
    for block in blocks(page):
        if block.lang in SHELL_LANGS:
            check_block(block, cwd, page_env())


@pytest.fixture(scope="module")
def page_runs(request, sandbox: Path, tmp_path_factory) -> Iterator[dict[Path, Future[None]]]:
    """The selected pages' runs, started at once on CONCURRENT_PAGES threads; each page's test
    waits for its own (a page's failure is its test's)."""
    test = test_every_shell_command_of_the_page_runs.__name__
    wanted = [
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "originalname", None) == test and item.module is request.module
    ]
    pool = ThreadPoolExecutor(CONCURRENT_PAGES, thread_name_prefix="docs-page")
    runs = {
        p: pool.submit(run_page, p, sandbox, tmp_path_factory.mktemp("page") / "work")
        for p in wanted
    }
    try:
        yield runs
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_shell_command_of_the_page_runs(page: Path, page_runs: dict[Path, Future[None]]):
    page_runs[page].result()


def test_every_command_is_run_or_excluded_and_every_exclusion_is_used():
    cmds = [c for b in shell_blocks() for c, _ in commands(b)]
    assert len(cmds) > 40  # the extraction finds the guide's commands
    for b in shell_blocks():
        assert commands(b), f"{rel(b.page)}:{b.line}: a shell block without a command"
    unused = [p for p, _ in EXCLUDED if not any(re.search(p, c) for c in cmds)]
    assert unused == [], "exclusions that match no command any more"
    # A command is run unless excluded; the excluded ones, for the record:
    assert all(excluded(c) or substituted(c, {"port": 1, "rdzv": 2}) for c in cmds)


def test_the_substitutions_shrink_training_and_keep_process_counts():
    ports = {"port": 5555, "rdzv": 6666}
    cmd = (
        "python -m nanotron_train.launch --standalone --nproc_per_node=4 --config-file run.yaml "
        "--override tokens.train_steps=400 --resume latest"
    )
    assert substituted(cmd, ports) == (
        "python -m nanotron_train.launch --standalone --nproc_per_node=4 --config-file run.yaml "
        "--override tokens.train_steps=2 --resume latest --override tokens.train_steps=2"
    )
    assert substituted("nanotron-dashboard --db runs.db --port 8008", ports).endswith("5555")
    assert excluded("sbatch --nodes=4 examples/slurm/train.sbatch") is not None
    assert excluded("python -m nanotron_train --config-file my.yaml") is None
