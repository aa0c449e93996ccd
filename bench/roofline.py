"""Roofline of a training step: model FLOP/s against the machine's matmul throughput for the
step's own GEMM shapes, measured in the same run, and where the rest of the step goes.

For a model (`--model small` or `peers`) the trainer runs as a user runs it (a record, a
metrics-file line and a log line every step, telemetry on). One step's GEMMs are captured
(shapes, layouts, order: bench/step_split.py); then rounds alternate `--steps` training steps
with replays of those GEMMs alone, so that the machine's drift hits both alike. Per round:

    model FLOP/s   = training FLOPs of a step (6N + attention, as the metrics record counts)
                     / the median step's wall time
    GEMM FLOP/s    = the step's GEMM FLOPs / the replay's wall time (each shape weighted by
                     its share of the FLOPs): the faster of two replays, the GEMMs as the
                     step runs them (oneDNN's linears included) and the same GEMMs with
                     those linears through torch's BLAS
    ratio          = model FLOP/s / GEMM FLOP/s   (1.0: the step runs as fast as its
                     matmuls alone would; attention's FLOPs count in the numerator, so a
                     step could exceed 1 only if attention ran faster than the GEMMs)

The figure is the median ratio over the rounds. A last block of steps runs under
torch.profiler and splits the step: matmul, attention, other ops (elementwise, copies,
reductions, indexing), optimizer (gradient norm, clipping and AdamW, whole), communication,
and host time (Python and autograd's engine outside any op). "Non-GEMM share" is everything
but matmul and attention. `--ops N` prints the N ops run most often per step.

    .venv/bin/python bench/roofline.py --model small [--rounds 5] [--steps 4] [--ops 25]
    .venv/bin/python bench/roofline.py --model peers [--dp 2 | --tp 2]

CPU only for now: on a GPU the timings would need device synchronisation, and the figure a
second denominator, the vendor's peak (reporting/device_peaks.py); not written yet. The
machine is shared and noisy: compare ratios from one run, not absolute figures.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time

import torch
from step_split import OPTIMIZER_RANGE, STEP_RANGE, GemmCapture, GemmReplay, split_profile
from torch.profiler import ProfilerActivity, profile, record_function

from nanotron_parallel.testing import run_distributed

MODELS = {
    # the small model: where per-step and per-parameter costs show
    "small": dict(hidden=256, ffn=688, layers=4, heads=8, kv=4, vocab=512, seq=256, mbs=4,
                  accum=2, tied=True),
    # the peers bench's model (../shared/bench-peers)
    "peers": dict(hidden=512, ffn=1536, layers=8, heads=8, kv=4, vocab=8192, seq=256, mbs=2,
                  accum=2, tied=False),
}  # fmt: skip


def bench_config(m: dict, metrics_file: str, dp: int = 1, tp: int = 1) -> dict:
    return {
        "general": {"seed": 1},
        "parallelism": {"dp": dp, "tp": tp, "pp": 1, "pp_engine": "1f1b",
                        "tp_mode": "ALL_REDUCE"},
        "model": {
            "model_config": {
                "hidden_size": m["hidden"], "intermediate_size": m["ffn"],
                "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
                "num_key_value_heads": m["kv"], "vocab_size": m["vocab"],
                "max_position_embeddings": m["seq"], "tie_word_embeddings": m["tied"],
            },
            "dtype": "float32",
        },
        "tokens": {"sequence_length": m["seq"], "micro_batch_size": m["mbs"],
                   "batch_accumulation_per_replica": m["accum"], "train_steps": 10**6},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 3e-4}, "clip_grad": 1.0,
                      "weight_decay": 0.01, "zero_stage": 0},
        "logging": {"iteration_step_info_interval": 1, "metrics_file": metrics_file},
    }  # fmt: skip


class Loop:
    """The trainer's loop body (Trainer.train), one step at a time: the step, its record and
    log line, telemetry, the checkpoint hook."""

    def __init__(self, cfg_dict: dict, pc) -> None:
        import nanotron_train.trainer as trainer_mod
        from nanotron_train.config import config_from_dict
        from nanotron_train.reporting.record import StepTimer

        cfg = config_from_dict(cfg_dict, "bench", world_size=None)
        self.tr = trainer_mod.Trainer(cfg, pc, stream=io.StringIO())
        self.timer = StepTimer(pc.device)
        for name in ("global_grad_norm", "clip_grads"):  # bench only: named ranges
            setattr(trainer_mod, name, _ranged(getattr(trainer_mod, name)))
        opt = self.tr.state.optimizer
        opt.step = _ranged(opt.step)
        self.tokens = cfg.global_batch_size * cfg.tokens.sequence_length // pc.dp_cp_size
        from nanotron_models.families import family_of
        from nanotron_train.model_factory import padded_model_config

        mc = padded_model_config(cfg.model)
        per_token = family_of(mc).training_flops_per_token(mc, cfg.tokens.sequence_length)
        self.flops = per_token * self.tokens / (pc.tp_size * pc.pp_size)  # this rank's share

    def step(self) -> float:
        t = time.perf_counter()
        tr = self.tr
        with record_function(STEP_RANGE):
            out = tr.train_step()
            self.timer.count()
            tr._record_if_due(out, self.timer, False, None, None)
            tr.telemetry.after_step(out.step)
            tr._save_if_due()
        return time.perf_counter() - t


def _ranged(fn):
    def wrapped(*args, **kwargs):
        with record_function(OPTIMIZER_RANGE):
            return fn(*args, **kwargs)

    return wrapped


def measure(model: str, dp: int, tp: int, args) -> dict:
    from nanotron_parallel.context import ParallelContext

    torch.set_num_threads(max(1, args.threads // (dp * tp)))
    pc = ParallelContext(dp=dp, tp=tp)
    with tempfile.TemporaryDirectory() as tmp:
        loop = Loop(bench_config(MODELS[model], os.path.join(tmp, "m.jsonl"), dp, tp), pc)
        for _ in range(args.warmup):
            loop.step()
        capture = GemmCapture()
        with capture:
            loop.step()
        replays = (GemmReplay(capture.calls), GemmReplay(capture.calls, blas=True))
        for replay in replays:
            replay.seconds()  # its tensors' first touch
        rounds = []
        for _ in range(args.rounds):
            step_s = statistics.median(loop.step() for _ in range(args.steps))
            # the step's GEMMs as it runs them, and through torch's BLAS: the faster counts
            as_run, blas = (
                statistics.median(r.seconds() for _ in range(args.replays)) for r in replays
            )
            rounds.append((step_s, min(as_run, blas), as_run, blas))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = sum(loop.step() for _ in range(args.profiled))
        split, counts = split_profile(prof.events(), args.profiled, wall)
        loop.tr.close()
    pc.destroy()
    return {"rounds": rounds, "flops": loop.flops, "gemm_flops": replays[0].flops,
            "split": split, "counts": counts, "shapes": replays[0].shapes}  # fmt: skip


def report(model: str, dp: int, tp: int, got: dict, args) -> None:
    m = MODELS[model]
    print(f"model {model}: hidden {m['hidden']}, ffn {m['ffn']}, {m['layers']} layers, "
          f"heads {m['heads']}/{m['kv']}, vocab {m['vocab']}, seq {m['seq']}, micro-batch "
          f"{m['mbs']} x {m['accum']}, tied {m['tied']}, fp32, AdamW, clip 1.0; dp={dp} tp={tp}, "
          f"{args.threads} threads in all")  # fmt: skip
    ratios = []
    for i, (step_s, gemm_s, as_run, blas) in enumerate(got["rounds"]):
        model_fs, gemm_fs = got["flops"] / step_s, got["gemm_flops"] / gemm_s
        ratios.append(model_fs / gemm_fs)
        print(f"round {i}: step {1e3 * step_s:7.1f} ms  model {model_fs / 1e9:6.1f} GFLOP/s  "
              f"GEMMs alone {1e3 * gemm_s:7.1f} ms = {gemm_fs / 1e9:6.1f} GFLOP/s (as run "
              f"{1e3 * as_run:.1f}, BLAS {1e3 * blas:.1f})  ratio {ratios[-1]:.3f}")  # fmt: skip
    print(f"GEMM FLOPs per step {got['gemm_flops'] / 1e9:.2f} G of model FLOPs "
          f"{got['flops'] / 1e9:.2f} G; {sum(got['shapes'].values())} GEMM calls, "
          f"{len(got['shapes'])} distinct shapes")  # fmt: skip
    print(f"model FLOP/s / shape-weighted GEMM FLOP/s (median of {len(ratios)} rounds): "
          f"{statistics.median(ratios):.3f}")  # fmt: skip
    split = got["split"]
    step = sum(split.values())
    print(f"profiled step split ({args.profiled} steps, ms per step and share):")
    for k, v in split.items():
        print(f"  {k:<20} {1e3 * v:8.1f}  {100 * v / step:5.1f}%")
    non_gemm = 1 - (split["matmul"] + split["attention"]) / step
    print(f"non-GEMM share (all but matmul and attention): {100 * non_gemm:.1f}%; "
          f"ops per step: {sum(got['counts'].values()):.0f}")  # fmt: skip
    for name, n in got["counts"].most_common(args.ops):
        print(f"  {n:8.1f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="in all (split over processes)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="training steps per round")
    ap.add_argument("--replays", type=int, default=3, help="GEMM replays per round")
    ap.add_argument("--profiled", type=int, default=3, help="steps under the profiler")
    ap.add_argument("--ops", type=int, default=0, help="print the N most frequent ops")
    args = ap.parse_args()
    world = args.dp * args.tp
    got = run_distributed(measure, world, args.model, args.dp, args.tp, args, timeout=1800)[0]
    report(args.model, args.dp, args.tp, got, args)


if __name__ == "__main__":
    main()
