"""Learning-rate transfer across width: the loss after a short run on real text at each
learning rate of a sweep, at two widths, under standard parametrization (sp) and µP (`mup`,
base width the smaller one). µP's promise is that the best learning rate stays where it is
when the model widens; under sp it moves (down, for Adam's hidden weights).

    python bench/mup_lr_sweep.py [--steps 30] [--widths 64 256] [--out mup_lr_sweep.svg]

Data: a slice of the default corpus (the Python stdlib's `asyncio` package, a 1,024-token
BPE; prepared once under .cache/). Model: 2 layers, heads of 16 dims, MLP 2x, untied
embeddings, sequences of 64 tokens, 8 per step, Adam with a constant rate after one warm-up
step, no clipping or decay. The loss is the mean of the last 5 steps' training losses (the
same batches for every run). One CPU process per run; prints the table and writes the curves
as an SVG (no plotting library needed).
"""

from __future__ import annotations

import argparse
import io
import math
import sysconfig
from pathlib import Path

import torch

from nanotron_parallel.context import ParallelContext
from nanotron_parallel.testing import shared_default_group
from nanotron_train.config import config_from_dict
from nanotron_train.data.corpus import prepare_default_corpus
from nanotron_train.trainer import Trainer

LRS = [2.0**k for k in range(-11, -2)]  # 4.9e-4 .. 0.125, one sweep step = 2x
SEQ, VOCAB = 64, 1024
COLOURS = {"sp": ("#d7301f", "#fc8d59"), "mup": ("#2166ac", "#67a9cf")}


def config(width: int, base: int, name: str, lr: float, steps: int, data: str) -> dict:
    model = {
        "model_config": {
            "hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": 2,
            "num_attention_heads": width // 16, "num_key_value_heads": width // 16,
            "vocab_size": VOCAB, "max_position_embeddings": SEQ, "tie_word_embeddings": False,
        },
        "init_method": {"std": 0.02},
        "dtype": "float32",
    }  # fmt: skip
    if name == "mup":
        model["parametrization"] = {"name": "mup", "base_hidden_size": base}
    return {
        "general": {"project": "bench", "run": "lr-sweep", "seed": 5},
        "model": model,
        "tokens": {"sequence_length": SEQ, "micro_batch_size": 4,
                   "batch_accumulation_per_replica": 2, "train_steps": steps},
        "optimizer": {
            "weight_decay": 0.0, "clip_grad": None,
            "learning_rate_scheduler": {"learning_rate": lr, "lr_warmup_steps": 1,
                                        "lr_decay_style": "linear", "min_decay_lr": lr},
        },
        "data_stages": [{"name": "s", "start_training_step": 1,
                         "data": {"dataset": {"dataset_folder": data}, "seed": 3}}],
        # every step's loss; the detectors' warnings (spikes, throughput drops) are off
        "logging": {"iteration_step_info_interval": 1, "log_level": "error"},
        "fault_tolerance": {"loss_spike_window": 0, "grad_norm_spike_window": 0},
    }  # fmt: skip


def best(losses: list[float]) -> int:
    """The index of the lowest finite loss (a diverged run is NaN)."""
    return min(range(len(losses)), key=lambda i: losses[i] if math.isfinite(losses[i]) else 1e9)


def final_loss(raw: dict) -> float:
    pc = ParallelContext(1, 1, 1)
    try:
        records: list[dict] = []
        Trainer(config_from_dict(raw, "bench"), pc, stream=io.StringIO()).train(records.append)
    finally:
        pc.destroy()
    tail = [r["lm_loss"] for r in records[-5:]]
    return sum(tail) / len(tail) if all(math.isfinite(x) for x in tail) else float("nan")


def svg(curves: dict[tuple[str, int], list[float]], path: Path) -> None:
    """Loss against log2(lr), one polyline per (parametrization, width); diverged points
    left out."""
    w, h, pad = 560, 360, 50
    finite = [v for c in curves.values() for v in c if math.isfinite(v)]
    lo, hi = min(finite), min(max(finite), min(finite) + 3.0)  # a diverged run off the top
    x = lambda i: pad + i * (w - 2 * pad) / (len(LRS) - 1)  # noqa: E731
    y = lambda v: h - pad - (min(v, hi) - lo) / (hi - lo) * (h - 2 * pad)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>']  # fmt: skip
    for i, lr in enumerate(LRS):
        out.append(
            f'<text x="{x(i):.0f}" y="{h - pad + 16}" text-anchor="middle">2^{int(math.log2(lr))}</text>'
        )
    out.append(f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">learning rate</text>')
    out.append(f'<text x="{pad - 40}" y="{pad - 20}">loss (mean of the last 5 steps)</text>')
    for k in range(5):
        v = lo + k * (hi - lo) / 4
        out.append(f'<text x="{pad - 6}" y="{y(v) + 4:.0f}" text-anchor="end">{v:.2f}</text>')
    for n, ((name, width), losses) in enumerate(sorted(curves.items())):
        colour = COLOURS[name][0 if width == min(wd for _, wd in curves) else 1]
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(losses) if math.isfinite(v))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"/>')
        b = best(losses)
        out.append(f'<circle cx="{x(b):.1f}" cy="{y(losses[b]):.1f}" r="4" fill="{colour}"/>')
        out.append(
            f'<text x="{w - pad - 110}" y="{pad + 14 * n}" fill="{colour}">{name} width {width}</text>'
        )
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=30)
    args.add_argument("--widths", type=int, nargs=2, default=[64, 256])
    args.add_argument("--out", default="mup_lr_sweep.svg")
    a = args.parse_args()
    torch.set_num_threads(1)
    root = str(Path(sysconfig.get_paths()["stdlib"]) / "asyncio")
    _, nanoset = prepare_default_corpus(".cache/data-lr-sweep", VOCAB, root=root, progress=False)
    base = min(a.widths)
    curves: dict[tuple[str, int], list[float]] = {}
    with shared_default_group():
        for name in ("sp", "mup"):
            for width in a.widths:
                curves[name, width] = [
                    final_loss(config(width, base, name, lr, a.steps, str(nanoset))) for lr in LRS
                ]
                print(name, width, " ".join(f"{v:.3f}" for v in curves[name, width]), flush=True)
    print(f"\nloss (mean of the last 5 of {a.steps} steps) per learning rate; * the best")
    print("parametrization  width  " + "  ".join(f"2^{int(math.log2(lr)):<4}" for lr in LRS))
    for (name, width), losses in curves.items():
        cells = [f"{v:5.3f}{'*' if i == best(losses) else ' '}" for i, v in enumerate(losses)]
        print(f"{name:<16} {width:<6} " + " ".join(cells))
    for name in ("sp", "mup"):
        moves = [int(math.log2(LRS[best(curves[name, w])])) for w in a.widths]
        print(f"{name}: best learning rate 2^{moves[0]} at width {a.widths[0]}, "
              f"2^{moves[1]} at width {a.widths[1]} ({moves[1] - moves[0]:+d} sweep steps)")  # fmt: skip
    svg(curves, Path(a.out))
    print(f"curves: {a.out}")


if __name__ == "__main__":
    main()
