"""Learning-rate transfer across width and depth: the loss after a short run on real text at
each learning rate of a 2x sweep. Across widths (at the base depth) under standard
parametrization (sp) and µP (`mup`, base width the smallest); across depths (at the base
width) under µP alone (no depth rule) and CompleteP (`completep`, alpha 1, base depth the
smallest). µP's promise is that the best rate stays put when the model widens, CompleteP's
that it also stays put when the model deepens; under sp it moves (down, for Adam's hidden
weights) with the width.

    python bench/mup_lr_sweep.py [--steps 40] [--widths 64 128 256] [--depths 2 4 8]
                                 [--seeds 1 2 3] [--jobs 2] [--out mup_lr_sweep.svg]
    python bench/mup_lr_sweep.py --quick    # seconds: a smoke run of the whole path

Data: a slice of the default corpus (the Python stdlib's `asyncio` package, a 1,024-token
BPE; prepared once under .cache/). Model: heads of 16 dims, MLP 2x, untied embeddings,
sequences of 64 tokens, 8 per step, Adam with a constant rate after one warm-up step, no
clipping or decay. A run's loss is the mean of its last 5 steps' training losses; a seed sets
the initial weights and the batches (the same batches for every rate and size of a seed); a
curve's point is the median over seeds. One CPU thread per run, `--jobs` runs at a time.
Prints the tables as Markdown and writes the curves as an SVG (bench/lr_sweep_svg.py).
"""

from __future__ import annotations

import argparse
import io
import math
import multiprocessing
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from lr_sweep_svg import best, write_svg  # bench/ is the script's folder, so on sys.path

from nanotron_parallel.context import ParallelContext
from nanotron_parallel.testing import shared_default_group
from nanotron_train.config import config_from_dict
from nanotron_train.data.corpus import prepare_default_corpus
from nanotron_train.trainer import Trainer

LRS = [2.0**k for k in range(-12, -2)]  # 2.4e-4 .. 0.125, one sweep step = 2x
SEQ, VOCAB, TAIL = 64, 1024, 5
Run = tuple[str, int, int, float, int]  # parametrization, width, depth, lr, seed


def config(run: Run, base_width: int, base_depth: int, steps: int, data: str) -> dict:
    name, width, depth, lr, seed = run
    model = {
        "model_config": {
            "hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": depth,
            "num_attention_heads": width // 16, "num_key_value_heads": width // 16,
            "vocab_size": VOCAB, "max_position_embeddings": SEQ, "tie_word_embeddings": False,
        },
        "init_method": {"std": 0.02},
        "dtype": "float32",
    }  # fmt: skip
    if name != "sp":
        model["parametrization"] = {"name": name, "base_hidden_size": base_width}
    if name == "completep":
        model["parametrization"] |= {"base_num_layers": base_depth, "completep_alpha": 1.0}
    return {
        "general": {"project": "bench", "run": "lr-sweep", "seed": seed},
        "model": model,
        "tokens": {"sequence_length": SEQ, "micro_batch_size": 4,
                   "batch_accumulation_per_replica": 2, "train_steps": steps},
        "optimizer": {
            "weight_decay": 0.0, "clip_grad": None,
            "learning_rate_scheduler": {"learning_rate": lr, "lr_warmup_steps": 1,
                                        "lr_decay_style": "linear", "min_decay_lr": lr},
        },
        "data_stages": [{"name": "s", "start_training_step": 1,
                         "data": {"dataset": {"dataset_folder": data}, "seed": seed}}],
        # every step's loss; the detectors' warnings (spikes, throughput drops on a loaded
        # machine) are off or as good as off
        "logging": {"iteration_step_info_interval": 1, "log_level": "error",
                    "throughput_drop_fraction": 0.01},
        "fault_tolerance": {"loss_spike_window": 0, "grad_norm_spike_window": 0},
    }  # fmt: skip


def final_loss(job: tuple[Run, int, int, int, str]) -> tuple[Run, float]:
    """One run in its own world of one (a pool worker runs many in turn)."""
    run, base_width, base_depth, steps, data = job
    torch.set_num_threads(1)
    records: list[dict] = []
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            raw = config(run, base_width, base_depth, steps, data)
            Trainer(config_from_dict(raw, "bench"), pc, stream=io.StringIO()).train(records.append)
        finally:
            pc.destroy()
    tail = [r["lm_loss"] for r in records[-TAIL:]]
    return run, sum(tail) / len(tail) if all(math.isfinite(x) for x in tail) else float("nan")


def curves_wanted(a: argparse.Namespace) -> dict[tuple[str, str, int], tuple[str, int, int]]:
    """(sweep, parametrization, size) -> the run's (parametrization, width, depth). CompleteP
    at the base depth is µP (every depth multiplier is 1), so that curve reuses µP's runs."""
    bw, bd = min(a.widths), min(a.depths)
    want = {("width", n, w): (n, w, bd) for n in ("sp", "mup") for w in a.widths}
    want |= {("depth", "mup", d): ("mup", bw, d) for d in a.depths}
    want |= {
        ("depth", "completep", d): ("completep" if d != bd else "mup", bw, d) for d in a.depths
    }
    return want


def median(xs: list[float]) -> float:
    """A diverged seed (NaN) counts as the worst."""
    m = statistics.median([x if math.isfinite(x) else math.inf for x in xs])
    return m if math.isfinite(m) else float("nan")


def table(sweep: str, rows: dict[tuple[str, int], list[list[float]]], lrs: list[float]) -> str:
    """Markdown: the median over seeds per rate (the best in bold), then each seed's best."""
    head = f"| parametrization | {sweep} | " + " | ".join(f"2^{int(math.log2(lr))}" for lr in lrs)
    lines = [head + " | best per seed |", "|---" * (len(lrs) + 3) + "|"]
    for (name, size), per_seed in rows.items():
        med = [median([s[i] for s in per_seed]) for i in range(len(lrs))]
        cells = [f"**{v:.3f}**" if i == best(med) else f"{v:.3f}" for i, v in enumerate(med)]
        seeds = ", ".join(f"2^{int(math.log2(lrs[best(s)]))}" for s in per_seed)
        lines.append(f"| {name} | {size} | " + " | ".join(cells) + f" | {seeds} |")
    return "\n".join(lines)


def moves(sweep: str, rows: dict[tuple[str, int], list[list[float]]], lrs: list[float]) -> str:
    out = []
    for name in dict.fromkeys(n for n, _ in rows):
        sizes = [s for n, s in rows if n == name]
        bests = []
        for s in sizes:
            per_seed = rows[name, s]
            bests.append(int(math.log2(lrs[best([median([p[i] for p in per_seed])
                                                 for i in range(len(lrs))])])))  # fmt: skip
        path = " -> ".join(f"2^{b}" for b in bests)
        span = max(bests) - min(bests)
        out.append(f"{name} across {sweep} {sizes}: best rate {path} (spread {span} sweep steps)")
    return "\n".join(out)


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=40)
    args.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    args.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    args.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args.add_argument("--jobs", type=int, default=1, help="runs at a time (processes)")
    args.add_argument("--quick", action="store_true", help="2 rates, 3 steps, tiny sizes")
    args.add_argument("--out", default="mup_lr_sweep.svg")
    a = args.parse_args()
    lrs = LRS
    if a.quick:
        lrs, a.steps, a.widths, a.depths, a.seeds = [2.0**-8, 2.0**-6], 6, [16, 32], [1, 2], [1]
    root = str(Path(sysconfig.get_paths()["stdlib"]) / "asyncio")
    _, nanoset = prepare_default_corpus(".cache/data-lr-sweep", VOCAB, root=root, progress=False)
    want = curves_wanted(a)
    runs = sorted(
        {(*r, lr, s) for r in want.values() for lr in lrs for s in a.seeds},
        key=lambda r: -r[1] * r[2],
    )  # biggest first: the pool ends together
    jobs = [(r, min(a.widths), min(a.depths), a.steps, str(nanoset)) for r in runs]
    print(f"{len(runs)} runs, {a.jobs} at a time", flush=True)
    loss: dict[Run, float] = {}
    start = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(a.jobs) as pool:
        for run, value in pool.imap_unordered(final_loss, jobs):
            loss[run] = value
            if len(loss) % 10 == 0:
                print(f"{len(loss)}/{len(runs)} runs, {time.monotonic() - start:.0f} s", flush=True)
    print(f"\nloss: the median over seeds {a.seeds} of the mean of the last {TAIL} of "
          f"{a.steps} steps; best per seed: each seed's own best rate\n")  # fmt: skip
    rows: dict[str, dict[tuple[str, int], list[list[float]]]] = {"width": {}, "depth": {}}
    for (sweep, name, size), (n, w, d) in want.items():
        rows[sweep][name, size] = [[loss[n, w, d, lr, s] for lr in lrs] for s in a.seeds]
    for sweep in ("width", "depth"):
        print(table(sweep, rows[sweep], lrs) + "\n")
        print(moves(sweep, rows[sweep], lrs) + "\n")
    panels = [
        (f"{name} across {sweep}", name,
         {f"{sweep} {s}": [median([p[i] for p in ps]) for i in range(len(lrs))]
          for (n, s), ps in rows[sweep].items() if n == name})
        for sweep, names in (("width", ("sp", "mup")), ("depth", ("mup", "completep")))
        for name in names
    ]  # fmt: skip
    write_svg(panels, lrs, f"loss (median over {len(a.seeds)} seeds, last {TAIL} steps)",
              Path(a.out))  # fmt: skip
    print(f"curves: {a.out}")


if __name__ == "__main__":
    main()
