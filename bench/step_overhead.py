"""Share of a training step spent outside forward and backward: ours vs a plain PyTorch loop.

Same Llama (our model, same weights), same micro-batches, same threads (one per process), at
dp=1 and dp=2. "Outside" is everything a step does besides the micro-batches' forwards and
backwards: gradient buffers and their reduction wait, the gradient norm, clipping, the
optimizer, bookkeeping. Ours is `Trainer.train_step` (the pipeline step is timed by wrapping
it); the plain loop is the textbook one: `loss.backward()` per micro-batch (DDP with `no_sync`
for all but the last at dp=2), `clip_grad_norm_`, `torch.optim.AdamW` (foreach), `zero_grad`.
Medians over the timed steps after warm-up; the aim is ours <= plain + 2 points.

    .venv/bin/python bench/step_overhead.py [--steps 12] [--warmup 3] [--hidden 512 --layers 8
        --vocab 8192 --seq 256]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import torch

from nanotron_parallel.testing import run_distributed


def bench_config(dp: int, args) -> dict:
    return {
        "general": {"seed": 1},
        "parallelism": {"dp": dp, "tp": 1, "pp": 1, "pp_engine": "1f1b"},
        "model": {
            "model_config": {
                "hidden_size": args.hidden, "intermediate_size": args.hidden * 8 // 3 // 64 * 64,
                "num_hidden_layers": args.layers, "num_attention_heads": 8,
                "num_key_value_heads": 8, "vocab_size": args.vocab,
                "max_position_embeddings": args.seq, "tie_word_embeddings": False,
            },
            "dtype": "float32",
        },
        "tokens": {"sequence_length": args.seq, "micro_batch_size": args.mbs,
                   "batch_accumulation_per_replica": args.accum, "train_steps": 10**6},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-4}, "clip_grad": 1.0,
                      "weight_decay": 0.01, "accumulate_grad_in_fp32": True, "zero_stage": 0},
        "logging": {"iteration_step_info_interval": 10**6},
    }  # fmt: skip


def _ours(dp: int, args) -> tuple[list[float], list[float]]:
    import nanotron_train.trainer as trainer_mod
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict

    pc = ParallelContext(dp=dp)
    cfg = config_from_dict(bench_config(dp, args), "bench", world_size=None)
    tr = trainer_mod.Trainer(cfg, pc, stream=io.StringIO())
    inner, fb = trainer_mod.run_pipeline_step, []

    def timed(*a, **k):  # bench only: time the forwards and backwards of the step
        t = time.perf_counter()
        out = inner(*a, **k)
        fb.append(time.perf_counter() - t)
        return out

    trainer_mod.run_pipeline_step = timed
    finish, waits = tr.grads.finish, []

    def timed_finish():  # the dp reduction's wait: DDP does it inside its backward
        t = time.perf_counter()
        finish()
        waits.append(time.perf_counter() - t)

    tr.grads.finish = timed_finish
    steps = []
    for _ in range(args.warmup + args.steps):
        t = time.perf_counter()
        tr.train_step()
        steps.append(time.perf_counter() - t)
    trainer_mod.run_pipeline_step = inner
    tr.close()
    pc.destroy()
    return steps[args.warmup :], fb[args.warmup :], waits[args.warmup :]


def _plain(dp: int, args) -> tuple[list[float], list[float]]:
    import contextlib

    import torch.distributed as dist

    from nanotron_models.model import build_llama
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.data.source import build_data
    from nanotron_train.model_factory import padded_model_config

    pc = ParallelContext(dp=dp)
    cfg = config_from_dict(bench_config(dp, args), "bench", world_size=None)
    model = build_llama(padded_model_config(cfg.model), pc, seed=1)
    data = build_data(cfg, pc)
    wrapped = model
    if dp > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=pc.dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    steps, fb = [], []
    for step in range(1, args.warmup + args.steps + 1):
        t = time.perf_counter()
        mbs = data.micro_batches(step)  # counted, as the trainer's step reads its data too
        t0_fb = time.perf_counter()
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            sync = contextlib.nullcontext() if last or dp == 1 else wrapped.no_sync()
            with sync:
                (wrapped(None, mb) / len(mbs)).backward()
        t_fb = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        end = time.perf_counter()
        steps.append(end - t)
        fb.append(t_fb - t0_fb)
    dist.barrier()
    pc.destroy()
    return steps[args.warmup :], fb[args.warmup :], [0.0] * args.steps


def measure(which: str, dp: int, args) -> tuple[float, float]:
    """On every rank: the median share of the step outside forward+backward, and that share
    without the dp reduction's wait."""
    torch.set_num_threads(1)
    steps, fb, waits = (_ours if which == "ours" else _plain)(dp, args)
    outside = statistics.median((s - f) / s for s, f in zip(steps, fb))
    no_wait = statistics.median((s - f - w) / s for s, f, w in zip(steps, fb, waits))
    return outside, no_wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--accum", type=int, default=2)
    args = parser.parse_args()
    print(f"model hidden={args.hidden} layers={args.layers} vocab={args.vocab} seq={args.seq} "
          f"mbs={args.mbs} accum={args.accum}, one thread per process")  # fmt: skip
    for dp in (1, 2):
        shares = {}
        for which in ("plain", "ours", "plain", "ours"):  # alternated: drifts hit both
            got = run_distributed(measure, dp, which, dp, args, timeout=900)[0]
            shares.setdefault(which, []).append(got)
        (ours, ours_no_wait), (plain, _) = min(shares["ours"]), min(shares["plain"])
        print(f"dp={dp}: share outside forward+backward: ours {100 * ours:.1f}%  "
              f"plain PyTorch loop {100 * plain:.1f}%  (difference {100 * (ours - plain):+.1f} "
              f"points; ours/plain {ours / plain:.2f})")  # fmt: skip
        if dp > 1:
            print(
                f"      ours without the dp reduction wait (DDP waits inside its backward): "
                f"{100 * ours_no_wait:.1f}% ({100 * (ours_no_wait - plain):+.1f} points)"
            )


if __name__ == "__main__":
    main()
