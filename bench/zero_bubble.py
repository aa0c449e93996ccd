"""Zero-bubble schedules: planned idle, activation memory and step time against 1F1B.

1. Planned idle share of a synchronous step with F = B = W (one slot each), for p = 2, 4, 8
   and m = 2p, 4p: 1F1B and interleaved 1F1B (v = 2) from their formulas, zb-h1 and zbv from
   their simulated plans (nanotron_parallel.pipeline.zb_plan; tests check plan = formula).
2. On the CPU, pp = 2 gloo processes, a Llama of equal stages (same layers per stage, the
   embedding and the head on the ends; zbv: four equal quarters in the V) and m = 8: per
   stage, the peak bytes autograd saves for backward (`track_activations`, held from F to W)
   under 1f1b, zb-h1, zb-h1-stage-memory (the planner's variant at 1F1B's memory on every
   stage) and zbv, each as a ratio to the same stage's 1f1b and to 1f1b's first stage; and the
   median step time zb-h1 / 1f1b, all in the same run.

    .venv/bin/python bench/zero_bubble.py [--steps 4] [--hidden 256] [--layers 4]

What 2 cores can show: each stage is one process with one thread, so with 2 free cores the
zb-h1 saving (W filling the cool-down) appears as a ratio below 1 only up to the bubble share
(about (p-1)/(m+p-1) - (p-1)/(3m+p-1) = 0.07 at p = 2, m = 8); on a loaded machine the
processes wait for a core and the ratio mostly measures that, plus the split's overhead (one
autograd call per W, weight-gradient closures).
"""

from __future__ import annotations

import argparse
import statistics
import time

from nanotron_parallel.pipeline.zb_plan import idle_formula, plan
from nanotron_parallel.testing import run_distributed


def idle_table() -> None:
    print("planned idle share of a step, F = B = W (zb-*, zbv: simulated plans)")
    names = ("zb-h1", "zb-h1-stage-memory", "zbv")
    print(f"{'p':>3} {'m':>4} {'1f1b':>7} {'interl.':>7} {'zb-h1':>7} {'zb-h1sm':>7} {'zbv':>7}")
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            row = [idle_formula("1f1b", p, m), idle_formula("interleaved-1f1b", p, m)]
            row += [plan(name, p, m).idle_share() for name in names]
            print(f"{p:>3} {m:>4} " + " ".join(f"{x:7.3f}" for x in row))


def _chunks(config, pc, layers: int, v_shape: bool):
    """Equal stages: this rank's half of the blocks (embedding + half the layers | the rest +
    norm, head, loss), or under zbv its two quarters in the V (rank 0: the two ends)."""
    import torch

    from nanotron_models import build_llama_stage, llama_block_names

    names = llama_block_names(config)
    if not v_shape:
        half = 1 + layers // 2
        return build_llama_stage(config, pc, names[:half] if pc.pp_rank == 0 else names[half:])
    q = layers // 4
    quarters = [names[: 1 + q], names[1 + q : 1 + 2 * q], names[1 + 2 * q : 1 + 3 * q],
                names[1 + 3 * q :]]  # fmt: skip
    mine = [quarters[pc.pp_rank], quarters[3 - pc.pp_rank]]  # virtual stages r and 2p - 1 - r
    holder = torch.nn.ModuleList([build_llama_stage(config, pc, n, seed=0) for n in mine])
    holder.chunks = list(holder)
    return holder


def _worker(steps: int, hidden: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist

    from nanotron_models import LlamaConfig
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.pipeline import run_pipeline_step
    from nanotron_parallel.pipeline.zero_bubble import train_step_zero_bubble

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pc = ParallelContext(pp=2)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=128, attn_backend="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    stage, v_chunks = _chunks(config, pc, layers, False), _chunks(config, pc, layers, True)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        ids = torch.randint(0, 512, (2, 129), generator=gen)
        batches.append(
            {"input_ids": ids[:, :-1], "label_ids": ids[:, 1:],
             "label_mask": torch.ones(2, 128, dtype=torch.bool)}
        )  # fmt: skip
    out = {}
    for name in ("1f1b", "zb-h1", "zb-h1-stage-memory", "zbv"):
        model = v_chunks if name == "zbv" else stage
        if name == "zb-h1-stage-memory":  # a plan of the planner, run by the zero-bubble runner
            res = train_step_zero_bubble(name, model, batches, pc, track_activations=True)
        else:
            res = run_pipeline_step(name, model, batches, pc, track_activations=True)
        out[name + "_bytes"] = res.stats.peak_saved_activation_bytes
        model.zero_grad(set_to_none=True)
    times = {"1f1b": [], "zb-h1": []}
    cpu = {"1f1b": [], "zb-h1": []}  # this stage's process CPU time: the work, not the waits
    for _ in range(steps):  # alternate engines so load changes hit both alike
        for engine in times:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            run_pipeline_step(engine, stage, batches, pc)
            c1 = time.process_time()
            dist.barrier()
            times[engine].append(time.perf_counter() - t0)
            cpu[engine].append(c1 - c0)
            stage.zero_grad(set_to_none=True)
    out.update({k + "_s": statistics.median(v) for k, v in times.items()})
    out.update({k + "_cpu": statistics.median(v) for k, v in cpu.items()})
    pc.destroy()
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    idle_table()
    results = run_distributed(_worker, 2, args.steps, args.hidden, args.layers, timeout=600)
    print("\npp=2, m=8, equal stages, CPU (gloo, 1 thread per stage): peak saved activations")
    base = results[0]["1f1b_bytes"]  # 1F1B's first stage: the pipeline's peak
    for rank, r in enumerate(results):
        cells = []
        for name in ("1f1b", "zb-h1", "zb-h1-stage-memory", "zbv"):
            mib, own = r[name + "_bytes"] / 2**20, r[name + "_bytes"] / r["1f1b_bytes"]
            cells.append(f"{name} {mib:.1f} MiB (x{own:.2f}, x{r[name + '_bytes'] / base:.2f})")
        print(f"stage {rank}: " + ", ".join(cells))
    print("(x own stage's 1f1b, x 1f1b's first stage)")
    r = results[0]
    print(
        f"step time: 1f1b {r['1f1b_s'] * 1e3:.0f} ms, zb-h1 {r['zb-h1_s'] * 1e3:.0f} ms, "
        f"ratio zb-h1/1f1b {r['zb-h1_s'] / r['1f1b_s']:.3f}"
    )
    for rank, r in enumerate(results):  # the split's own cost, whatever else runs
        print(
            f"stage {rank} CPU time per step: 1f1b {r['1f1b_cpu'] * 1e3:.0f} ms, zb-h1 "
            f"{r['zb-h1_cpu'] * 1e3:.0f} ms, ratio {r['zb-h1_cpu'] / r['1f1b_cpu']:.3f}"
        )


if __name__ == "__main__":
    main()
