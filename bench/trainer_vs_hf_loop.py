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

With `--paired` both loops run in one process instead, a step of each in turn (`--steps`
pairs, the order switching every pair), so that this machine's drift, which moves a step by
20% from one minute to the next, hits both alike: the figure is the median of the pairs'
ratios. Then `--profiled` steps of each under torch.profiler, split as bench/roofline.py
splits a step (matmul, attention, other ops, optimizer, host), side by side: the fixed
per-step time of each loop is everything but matmul and attention.

    .venv/bin/python bench/trainer_vs_hf_loop.py [--runs 3] [--steps 10] [--threads 2]
        [--hidden 256 --ffn 688 --layers 4 --vocab 512 --seq 256 --mbs 4 --accum 2]
    .venv/bin/python bench/trainer_vs_hf_loop.py --paired --steps 30 [--profiled 4] [--blas]

With tiny dimensions (`--hidden 64 --ffn 128 --seq 16 --mbs 1`) the step is almost all
per-step and per-parameter fixed cost: the two loops' fixed costs compare directly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import Counter

import torch
import torch.nn.functional as F
from roofline import Loop, bench_config
from step_split import OPTIMIZER_RANGE, STEP_RANGE, split_profile
from torch.profiler import ProfilerActivity, profile, record_function

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


class PlainLoop:
    """The textbook transformers loop, one step at a time (its optimizer part in the split's
    optimizer range, the whole step in its step range, as bench/roofline.py's `Loop`)."""

    def __init__(self, args) -> None:
        import transformers

        torch.manual_seed(1)
        hf_config = transformers.LlamaConfig(
            hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv, vocab_size=args.vocab,
            max_position_embeddings=args.seq, tie_word_embeddings=True, attn_implementation="sdpa",
        )  # fmt: skip
        self.model = transformers.LlamaForCausalLM(hf_config).float().train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                     eps=1e-8, weight_decay=0.01)  # fmt: skip
        self.gen = torch.Generator().manual_seed(1)
        self.args = args

    def step(self) -> float:
        args, model = self.args, self.model
        t = time.perf_counter()
        with record_function(STEP_RANGE):
            total = 0.0
            for _ in range(args.accum):  # synthetic tokens, as ours (made inside the step)
                ids = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=self.gen)
                logits = model(ids[:, :-1]).logits
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                (loss / args.accum).backward()
                total += loss.detach()
            with record_function(OPTIMIZER_RANGE):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            float(total / args.accum)  # the log line's loss
        return time.perf_counter() - t


def run_plain(args) -> list[float]:
    torch.set_num_threads(args.threads)
    loop = PlainLoop(args)
    times = [loop.step() for _ in range(args.warmup + args.steps)]
    return times[args.warmup :]


def run_paired(args) -> dict:
    """Both loops in this one process, a step of each in turn (the order switching every
    pair), so that the machine's drift from one second to the next hits both alike; then
    `--profiled` steps of each under torch.profiler, alternated the same way, split as
    bench/roofline.py splits a step."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.tensor_parallel import cpu_gemm

    cpu_gemm.enabled = cpu_gemm.enabled and not args.blas
    torch.set_num_threads(args.threads)
    pc = ParallelContext()
    with tempfile.TemporaryDirectory() as tmp:
        ours = Loop(bench_config(_model_dims(args), os.path.join(tmp, "m.jsonl")), pc)
        loops = {"ours": ours.step, "plain": PlainLoop(args).step}
        for _ in range(args.warmup):
            for step in loops.values():
                step()
        times: dict[str, list[float]] = {"ours": [], "plain": []}
        splits = {"ours": Counter(), "plain": Counter()}
        for i in range(args.steps + args.profiled):
            for which in ("ours", "plain") if i % 2 == 0 else ("plain", "ours"):
                if i < args.steps:
                    times[which].append(loops[which]())
                    continue
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    wall = loops[which]()
                splits[which].update(split_profile(prof.events(), 1, wall)[0])
        ours.tr.close()
    pc.destroy()
    n = max(1, args.profiled)
    return {"times": times, "splits": {k: {c: v / n for c, v in s.items()} for k, s in
                                        splits.items()}}  # fmt: skip


def report_paired(got: dict) -> None:
    ours, plain = got["times"]["ours"], got["times"]["plain"]
    ratios = [p / o for o, p in zip(ours, plain)]
    print(f"paired steps ({len(ratios)}): ours median {1e3 * statistics.median(ours):.1f} ms, "
          f"plain loop median {1e3 * statistics.median(plain):.1f} ms; plain/ours per pair: "
          f"median {statistics.median(ratios):.3f} (quartiles "
          f"{' / '.join(f'{q:.3f}' for q in statistics.quantiles(ratios, n=4))})")  # fmt: skip
    so, sp = got["splits"]["ours"], got["splits"]["plain"]
    if not sum(so.values()):
        return
    print(f"profiled split, ms per step:  {'ours':>8} {'plain':>8}")
    for cat in so:
        print(f"  {cat:<26} {1e3 * so[cat]:8.1f} {1e3 * sp[cat]:8.1f}")
    for name, s in (("ours", so), ("plain", sp)):
        total = sum(s.values())
        rest = total - s["matmul"] - s["attention"]
        print(f"  {name}: step {1e3 * total:.1f} ms, matmul + attention {1e3 * (total - rest):.1f}"
              f" ms, the rest (fixed per-step time) {1e3 * rest:.1f} ms = {100 * rest / total:.1f}%")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 256), ("ffn", 688), ("layers", 4), ("heads", 8),
                          ("kv", 4), ("vocab", 512), ("seq", 256), ("mbs", 4), ("accum", 2),
                          ("runs", 3), ("steps", 10), ("warmup", 3), ("threads", 2),
                          ("profiled", 4)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--paired", action="store_true",
                    help="both loops in one process, a step of each in turn, and their "
                         "profiled split side by side")  # fmt: skip
    ap.add_argument("--blas", action="store_true",
                    help="with --paired: our linears' GEMMs through torch's BLAS, as before "
                         "tensor_parallel/cpu_gemm.py")  # fmt: skip
    args = ap.parse_args()
    print(f"hidden {args.hidden}, ffn {args.ffn}, {args.layers} layers, heads "
          f"{args.heads}/{args.kv}, vocab {args.vocab}, seq {args.seq}, micro-batch {args.mbs} "
          f"x {args.accum}, tied, fp32, AdamW, clip 1.0, {args.threads} threads")  # fmt: skip
    if args.paired:
        report_paired(run_distributed(run_paired, 1, args, timeout=3600)[0])
        return
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
