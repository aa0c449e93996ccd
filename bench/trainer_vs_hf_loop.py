"""Our trainer against a plain Hugging Face `transformers` training loop, same model and batch.

The plain loop is the textbook one: `LlamaForCausalLM` (SDPA attention), per micro-batch
`F.cross_entropy(logits, labels) / m` and `backward()`, then `clip_grad_norm_(1.0)`,
`torch.optim.AdamW` (torch's defaults on the CPU), `zero_grad(set_to_none=True)` and the loss
read for a log line. Ours is the trainer's loop as a user runs it (bench/roofline.py's
`Loop`: a record, a metrics-file line and a log line every step, telemetry on), the same
dimensions, tied embeddings, fp32, AdamW (β 0.9/0.95, eps 1e-8, wd 0.01), clipping at 1.0.

Runs alternate between fresh processes (ours, plain; then plain, ours; ...), each timing
`--steps` steps after `--warmup`; a run's figure is its median step. The printed ratio is
plain / ours step time (above 1: the trainer is faster), the median over `--runs` pairs.

    .venv/bin/python bench/trainer_vs_hf_loop.py [--runs 3] [--steps 10] [--threads 2]
        [--hidden 256 --ffn 688 --layers 4 --vocab 512 --seq 256 --mbs 4 --accum 2]

With tiny dimensions (`--hidden 64 --ffn 128 --seq 16 --mbs 1`) the step is almost all
per-step and per-parameter fixed cost: the two loops' fixed costs compare directly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from roofline import Loop, bench_config

from nanotron_parallel.testing import run_distributed


def _model_dims(args) -> dict:
    return dict(hidden=args.hidden, ffn=args.ffn, layers=args.layers, heads=args.heads,
                kv=args.kv, vocab=args.vocab, seq=args.seq, mbs=args.mbs, accum=args.accum,
                tied=True)  # fmt: skip


def run_ours(args) -> list[float]:
    from nanotron_parallel.context import ParallelContext

    torch.set_num_threads(args.threads)
    pc = ParallelContext()
    with tempfile.TemporaryDirectory() as tmp:
        loop = Loop(bench_config(_model_dims(args), os.path.join(tmp, "m.jsonl")), pc)
        times = [loop.step() for _ in range(args.warmup + args.steps)]
        loop.tr.close()
    pc.destroy()
    return times[args.warmup :]


def run_plain(args) -> list[float]:
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    hf_config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv, vocab_size=args.vocab,
        max_position_embeddings=args.seq, tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(hf_config).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(args.warmup + args.steps):
        t = time.perf_counter()
        total = 0.0
        for _ in range(args.accum):  # synthetic tokens, as ours (made inside the step)
            ids = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=gen)
            logits = model(ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            (loss / args.accum).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(total / args.accum)  # the log line's loss
        times.append(time.perf_counter() - t)
    return times[args.warmup :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 256), ("ffn", 688), ("layers", 4), ("heads", 8),
                          ("kv", 4), ("vocab", 512), ("seq", 256), ("mbs", 4), ("accum", 2),
                          ("runs", 3), ("steps", 10), ("warmup", 3), ("threads", 2)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args()
    print(f"hidden {args.hidden}, ffn {args.ffn}, {args.layers} layers, heads "
          f"{args.heads}/{args.kv}, vocab {args.vocab}, seq {args.seq}, micro-batch {args.mbs} "
          f"x {args.accum}, tied, fp32, AdamW, clip 1.0, {args.threads} threads")  # fmt: skip
    ratios = []
    for r in range(args.runs):
        order = ("ours", "plain") if r % 2 == 0 else ("plain", "ours")
        med = {}
        for which in order:
            fn = run_ours if which == "ours" else run_plain
            med[which] = statistics.median(run_distributed(fn, 1, args, timeout=1800)[0])
        ratios.append(med["plain"] / med["ours"])
        print(f"run {r}: ours {1e3 * med['ours']:.1f} ms/step, plain loop "
              f"{1e3 * med['plain']:.1f} ms/step, plain/ours {ratios[-1]:.3f}")  # fmt: skip
    print(f"trainer / plain transformers loop (throughput, median of {args.runs} runs): "
          f"{statistics.median(ratios):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
