"""False alarms of the trainer's detectors on healthy runs, and the real faults they must catch.

    .venv/bin/python bench/dashboard_false_alarms.py [--runs 20] [--steps 150]

1. Gradient-norm and loss spikes (fault/spikes.py): `--runs` healthy short trainings of a
   small Llama in this process (synthetic learnable data; seeds 0..runs-1, over three layouts
   of the batch: micro-batch x accumulation 2x2, 4x1, 1x4, and two learning rates), each
   step's grad_norm and lm_loss replayed through the detectors as the trainer configures
   them (window 100, z 6), before (z-score alone) and now (also >= GRAD_NORM_MIN_RATIO x the
   median for the gradient norm). Prints the false alarms of each, the largest healthy
   value/median seen where z > 6, and whether a 30x step (the tests' injected spike) fires.
2. Stragglers (telemetry/stragglers.py) on `--runs` simulated dp=2 x pp=2 runs of 60
   intervals: each rank's busy time is its stage's base (the last stage 1.5x) times
   lognormal noise (sigma 0.08) and, as seen on a 2-core machine running 4 processes,
   episodes of 1-3 intervals (p = 0.08 per rank and interval) at 1.5-2.1x. Undisturbed runs
   count false alarms; in the same runs with rank 3 slowed 2x from interval 20 on, the
   intervals until it is named. The old detector (ratio > 1 + margin for `intervals` in a
   row) beside the new one (noise model), at margin 0.2 and 0.5, intervals 3.
"""

from __future__ import annotations

import argparse
import io
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotron_train.fault.spikes import GRAD_NORM_MIN_RATIO, LossSpikeDetector  # noqa: E402
from nanotron_train.telemetry.stragglers import StragglerDetector  # noqa: E402

LAYOUTS = [(2, 2), (4, 1), (1, 4)]  # micro-batch size, accumulation
LRS = [3e-3, 1e-3]


def config(seed: int, steps: int, mbs: int, accum: int, lr: float) -> dict:
    return {
        "general": {"project": "bench", "run": f"healthy-{seed}", "seed": seed},
        "parallelism": {"dp": 1, "tp": 1, "pp": 1},
        "model": {
            "model_config": {
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                "max_position_embeddings": 64, "tie_word_embeddings": True,
            },
            "init_method": {"std": 0.02},
            "dtype": "float32",
        },
        "tokens": {"sequence_length": 32, "micro_batch_size": mbs,
                   "batch_accumulation_per_replica": accum, "train_steps": steps},
        "optimizer": {
            "weight_decay": 0.01, "clip_grad": 1.0,
            "learning_rate_scheduler": {
                "learning_rate": lr, "lr_warmup_steps": 10, "lr_decay_style": "cosine",
                "min_decay_lr": lr / 10,
            },
        },
        "checkpoints": {"checkpoints_path": None, "checkpoint_interval": 10**6},
        "data_stages": [{"name": "s", "start_training_step": 1,
                         "data": {"dataset": None, "seed": seed}}],
        # a loaded machine's slow step is not what this bench counts
        "logging": {"iteration_step_info_interval": 1, "throughput_drop_fraction": 0.001},
    }  # fmt: skip


def healthy_series(seed: int, steps: int) -> tuple[list[float], list[float]]:
    """(grad_norm, lm_loss) of one healthy training."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    mbs, accum = LAYOUTS[seed % len(LAYOUTS)]
    lr = LRS[(seed // len(LAYOUTS)) % len(LRS)]
    cfg = config_from_dict(config(seed, steps, mbs, accum, lr), "bench")
    records: list[dict] = []
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            Trainer(cfg, pc, stream=io.StringIO()).train(on_record=records.append)
        finally:
            pc.destroy()
    return [r["grad_norm"] for r in records], [r["lm_loss"] for r in records]


def alarms(values: list[float], min_ratio: float) -> tuple[int, float]:
    """(spikes flagged, largest value/median where z > 6) through a fresh detector."""
    det = LossSpikeDetector(100, 6.0, min_ratio)
    n, worst = 0, 0.0
    for v in values:
        scored = det.score(v)
        if scored is not None and scored[0] > 6.0:
            worst = max(worst, scored[1])
        n += det.observe(v) is not None
    return n, worst


def spikes(runs: int, steps: int) -> None:
    old_g = new_g = old_l = runs_alarmed_old = runs_alarmed_new = 0
    worst_g = worst_l = 0.0
    caught = 0
    t0 = time.perf_counter()
    for seed in range(runs):
        norms, losses = healthy_series(seed, steps)
        a, w = alarms(norms, 1.0)
        b, _ = alarms(norms, GRAD_NORM_MIN_RATIO)
        c, wl = alarms(losses, 1.0)
        old_g, new_g, old_l = old_g + a, new_g + b, old_l + c
        runs_alarmed_old += a > 0
        runs_alarmed_new += b > 0
        worst_g, worst_l = max(worst_g, w), max(worst_l, wl)
        spiked = norms[: steps // 2] + [30.0 * norms[steps // 2]]
        caught += alarms(spiked, GRAD_NORM_MIN_RATIO)[0] == 1
        print(
            f"  run {seed}: grad_norm alarms z-only {a}, now {b}; loss alarms {c}; "
            f"largest grad_norm/median at z > 6: {w:.2f}x",
            flush=True,
        )
    print(f"spikes: {runs} healthy runs x {steps} steps ({time.perf_counter() - t0:.0f} s)")
    print(f"  grad_norm_spike, z > 6 alone:        {old_g} alarms in {runs_alarmed_old} runs")
    print(
        f"  grad_norm_spike, z > 6 and >= {GRAD_NORM_MIN_RATIO}x:  {new_g} alarms in "
        f"{runs_alarmed_new} runs"
    )
    print(f"  largest healthy grad_norm/median where z > 6: {worst_g:.2f}x")
    print(
        f"  loss_spike (z > 6): {old_l} alarms; largest healthy loss/median at z > 6: {worst_l:.2f}x"
    )
    print(f"  a 30x grad_norm at mid-run flagged in {caught}/{runs} runs")


def simulated_run(rng: random.Random, intervals: int, slow_from: int | None) -> list[list[dict]]:
    episode = [0, 0, 0, 0]  # intervals left of each rank's shared-core episode
    factor = [1.0] * 4
    out = []
    for t in range(intervals):
        ranks = []
        for r in range(4):
            if episode[r] == 0 and rng.random() < 0.08:
                episode[r], factor[r] = rng.randint(1, 3), rng.uniform(1.5, 2.1)
            hiccup = factor[r] if episode[r] > 0 else 1.0
            episode[r] = max(0, episode[r] - 1)
            pp = r // 2
            busy = 10.0 * (1.5 if pp else 1.0) * math.exp(rng.gauss(0, 0.08)) * hiccup
            if slow_from is not None and r == 3 and t >= slow_from:
                busy *= 2.0
            ranks.append({"rank": r, "pp": pp, "compute_ms": busy})
        out.append(ranks)
    return out


class OldDetector:
    """The previous rule: ratio > 1 + margin for `intervals` in a row."""

    def __init__(self, margin: float, intervals: int) -> None:
        self.inner = StragglerDetector(margin, intervals)
        self.margin, self.intervals, self.slow = margin, intervals, {}

    def observe(self, ranks: list[dict]) -> list[tuple[dict, float]]:
        found = []
        for e in ranks:
            ratio = self.inner.ratios(ranks)[e["rank"]]
            n = self.slow.get(e["rank"], 0) + 1 if ratio > 1 + self.margin else 0
            self.slow[e["rank"]] = n
            if n == self.intervals:
                found.append((e, ratio))
        return found


def stragglers(runs: int) -> None:
    print(f"stragglers: {runs} simulated dp=2 x pp=2 runs of 60 intervals")
    for margin, k in ((0.2, 3), (0.5, 3), (0.2, 6), (0.5, 6)):
        for name, make in (("old", OldDetector), ("new", StragglerDetector)):
            rng = random.Random(1)
            false = runs_with = 0
            delays, missed, wrong = [], 0, 0
            for _ in range(runs):
                det = make(margin, k)
                n = sum(len(det.observe(ranks)) for ranks in simulated_run(rng, 60, None))
                false += n
                runs_with += n > 0
                det = make(margin, k)
                named = None
                for t, ranks in enumerate(simulated_run(rng, 60, 20)):
                    for e, _ in det.observe(ranks):
                        # an episode of rank 3 named just before the slowdown runs into it
                        # (its count never falls to 0): that counts as naming it
                        if e["rank"] == 3 and t >= 20 - k and named is None:
                            named = max(1, t - 20 + 1)
                        elif e["rank"] != 3 and t >= 20:
                            wrong += 1
                if named is None:
                    missed += 1
                else:
                    delays.append(named)
            delay = f"median {statistics.median(delays):.0f}, max {max(delays)}" if delays else "-"
            print(
                f"  {name} margin {margin} intervals {k}: undisturbed: {false} events in {runs_with}/{runs} "
                f"runs; rank 3 slowed 2x: named in {runs - missed}/{runs} runs after {delay} "
                f"intervals, {wrong} events naming another rank"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip-training", action="store_true", help="only the straggler part")
    args = p.parse_args()
    stragglers(args.runs)
    if not args.skip_training:
        spikes(args.runs, args.steps)


if __name__ == "__main__":
    main()
