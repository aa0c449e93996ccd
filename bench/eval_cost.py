"""Cost of an evaluation against the forward share of training, same model, same micro-batches.

One process (CPU, or the GPU when there is one), a small Llama built by the Trainer with a
`validation` folder of random ids. Reference: the forwards of B training micro-batches as a
training step runs them (grad enabled, the autograd graph recorded, then dropped). Measured:
`Evaluator.evaluate()` over B validation batches of the same size (forward-only schedule,
no_grad, eval mode, token-weighted loss, the final all-reduces and the one host read). The
ratio evaluation / training forwards should be <= 1; the full training step (forward and
backward) is printed for scale. Medians over --repeats.

    .venv/bin/python bench/eval_cost.py [--batches 8] [--hidden 256] [--layers 4] [--seq 256]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch


def config(args, folder: str) -> dict:
    return {
        "general": {"project": "bench", "run": "eval_cost", "seed": 1},
        "model": {
            "model_config": {
                "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
                "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
                "num_key_value_heads": args.hidden // 64, "vocab_size": 4096,
                "max_position_embeddings": args.seq,
            },
            "dtype": "bfloat16" if torch.cuda.is_available() else "float32",
        },
        "tokens": {"sequence_length": args.seq, "micro_batch_size": args.mbs,
                   "batch_accumulation_per_replica": 1, "train_steps": 1,
                   "limit_val_batches": args.batches},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-4}},
        "validation": {"dataset": {"dataset_folder": folder}},
    }  # fmt: skip


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=8, help="B: micro-batches of each side")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.data.testing import make_id_nanoset
    from nanotron_train.trainer import Trainer

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # a shared machine: one core, the same for both sides
    with tempfile.TemporaryDirectory() as tmp:
        samples = args.batches * args.mbs
        folder = make_id_nanoset(Path(tmp) / "val", [args.seq + 1] * (samples + 1), high=4096,
                                 vocab_size=4096)  # fmt: skip
        cfg = config_from_dict(config(args, str(folder)), "bench")
        pc = ParallelContext(dp=1, tp=1, pp=1)
        trainer = Trainer(cfg, pc, stream=io.StringIO())
        model, evaluator = trainer.state.model, trainer.evaluator
        micro_batches = [
            {k: v.to(pc.device) for k, v in mb.items()}
            for mbs, _ in evaluator.data.batches()
            for mb in mbs
        ]
        assert len(micro_batches) == args.batches

        def train_forwards() -> None:
            for mb in micro_batches:
                model(None, mb)  # the graph is recorded, as in a training step, then dropped

        def train_steps() -> None:
            for mb in micro_batches:
                model(None, mb).backward()

        train_forwards(), evaluator.evaluate(), train_steps()  # warm-up
        fwd, ev, full = [], [], []
        for _ in range(args.repeats):
            fwd.append(timed(train_forwards, pc.device))
            ev.append(timed(evaluator.evaluate, pc.device))
            full.append(timed(train_steps, pc.device))
        trainer.close()
        pc.destroy()
    f, e, s = (statistics.median(x) for x in (fwd, ev, full))
    tokens = args.batches * args.mbs * args.seq
    print(f"device {pc.device}, hidden {args.hidden}, layers {args.layers}, seq {args.seq}, "
          f"mbs {args.mbs}, B = {args.batches} micro-batches ({tokens} tokens)")  # fmt: skip
    print(f"training forwards (grad on): {f * 1e3:.1f} ms | evaluation: {e * 1e3:.1f} ms | "
          f"training forward+backward: {s * 1e3:.1f} ms")  # fmt: skip
    print(f"ratio evaluation / forward share of training: {e / f:.3f} (aim <= 1); "
          f"evaluation / full training micro-batches: {e / s:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
