"""Cost of the per-rank telemetry on the training step: step time with it on vs off.

Two Trainers of the same small Llama in this launch, one with `logging.rank_stats_interval`
at its default (10) and `pipeline_timeline_interval` as given (default 0, its default), one
with telemetry off (both 0). They run alternately in blocks of --block steps (a multiple of the
interval, so each block pays its interval gathers), --repeats times; the printed ratio is the
median step time with telemetry over the median without (aim <= 1.02), and the median of the
per-repeat ratios (the two sides alternate which goes first). Runs on the CPU (one
thread per process) or on the GPU when there is one (bf16); under torchrun every rank runs it
(pass --dp/--tp/--pp matching the processes) and rank 0 prints.

    .venv/bin/python bench/telemetry_cost.py [--hidden 256] [--layers 4] [--seq 256]
    torchrun --nproc_per_node=2 bench/telemetry_cost.py --tp 2
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import torch


def config(args, telemetry: bool) -> dict:
    cuda = torch.cuda.is_available()
    return {
        "general": {"project": "bench", "run": "telemetry_cost", "seed": 1},
        "parallelism": {"dp": args.dp, "tp": args.tp, "pp": args.pp, "pp_engine": "1f1b"},
        "model": {
            "model_config": {
                "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
                "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
                "num_key_value_heads": args.hidden // 64, "vocab_size": 4096,
                "max_position_embeddings": args.seq,
            },
            "dtype": "bfloat16" if cuda else "float32",
        },
        "tokens": {"sequence_length": args.seq, "micro_batch_size": args.mbs,
                   "batch_accumulation_per_replica": args.accum, "train_steps": 10**9},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-4}},
        "logging": {
            "iteration_step_info_interval": 10**6,  # no logged step inside the measurement
            "rank_stats_interval": 10 if telemetry else 0,
            "pipeline_timeline_interval": args.timeline if telemetry else 0,
        },
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--timeline", type=int, default=0, help="pipeline_timeline_interval when on")
    p.add_argument("--block", type=int, default=20, help="steps per block (a multiple of 10)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # a shared machine: one core per process, both sides alike
    pc = ParallelContext(dp=args.dp, tp=args.tp, pp=args.pp)
    on = Trainer(config_from_dict(config(args, True), "bench"), pc, stream=io.StringIO())
    off = Trainer(config_from_dict(config(args, False), "bench"), pc, stream=io.StringIO())

    cpu_times: dict[int, list[float]] = {id(on): [], id(off): []}

    def block(trainer: Trainer) -> float:
        """Seconds per step over one block, the interval's gathers included (and, aside, the
        CPU seconds of this process: on a shared CPU machine other jobs' load shows in the
        wall time, much less in our own CPU time)."""
        if pc.device.type == "cuda":
            torch.cuda.synchronize(pc.device)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.block):
            out = trainer.train_step()
            trainer.telemetry.after_step(out.step)
        if pc.device.type == "cuda":
            torch.cuda.synchronize(pc.device)
        cpu_times[id(trainer)].append((time.process_time() - c0) / args.block)
        return (time.perf_counter() - t0) / args.block

    block(on), block(off)  # warm-up: allocator, p2p shapes, first gathers
    with_t, without = [], []
    for i in range(args.repeats):  # alternate which side goes first: no order bias
        if i % 2 == 0:
            with_t.append(block(on))
            without.append(block(off))
        else:
            without.append(block(off))
            with_t.append(block(on))
    on.close(), off.close()
    a, b = statistics.median(with_t), statistics.median(without)
    pairs = statistics.median(x / y for x, y in zip(with_t, without))
    if pc.rank == 0:
        tokens = args.mbs * args.accum * args.seq * args.dp
        print(f"device {pc.device}, world {pc.world_size} (dp={args.dp} tp={args.tp} "
              f"pp={args.pp}), hidden {args.hidden}, layers {args.layers}, {tokens} tokens/step, "
              f"{args.repeats} x {args.block} steps each")  # fmt: skip
        print(f"step time: telemetry on (rank_stats_interval=10, pipeline_timeline_interval="
              f"{args.timeline}) {a * 1e3:.2f} ms | off {b * 1e3:.2f} ms")  # fmt: skip
        print(f"ratio on / off: {a / b:.4f} (aim <= 1.02); median of the paired block "
              f"ratios: {pairs:.4f}")  # fmt: skip
        cpu_on, cpu_off = (statistics.median(cpu_times[id(t)][1:]) for t in (on, off))
        print(f"CPU time per step of this process: on {cpu_on * 1e3:.2f} ms | off "
              f"{cpu_off * 1e3:.2f} ms | ratio {cpu_on / cpu_off:.4f}")  # fmt: skip
    pc.destroy()


if __name__ == "__main__":
    main()
