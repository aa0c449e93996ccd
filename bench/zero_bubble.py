"""Zero-bubble schedules: planned idle, activation memory and step time against 1F1B.

1. Planned idle share of a synchronous step with F = B = W (one slot each), for p = 2, 4, 8
   and m = 2p, 4p: 1F1B and interleaved 1F1B (v = 2) from their formulas, zb-h1 and zbv from
   their simulated plans (nanotron_parallel.pipeline.zb_plan; tests check plan = formula).
2. On the CPU, pp = 2 gloo processes, a Llama of equal stages (same layers per stage, the
   embedding and the head on the ends) and m = 8: per stage, the peak bytes autograd saves for
   backward (`track_activations`, held from F to W under zb-h1) and the median step time, each
   zb-h1 / 1f1b in the same run.

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
    print("planned idle share of a step, F = B = W (zb-h1, zbv: simulated plans)")
    print(f"{'p':>3} {'m':>4} {'1f1b':>7} {'interl.':>7} {'zb-h1':>7} {'zbv':>7}")
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            row = [idle_formula("1f1b", p, m), idle_formula("interleaved-1f1b", p, m)]
            row += [plan("zb-h1", p, m).idle_share(), plan("zbv", p, m).idle_share()]
            print(f"{p:>3} {m:>4} " + " ".join(f"{x:7.3f}" for x in row))


def _worker(steps: int, hidden: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist

    from nanotron_models import LlamaConfig, build_llama_stage, llama_block_names
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.pipeline import run_pipeline_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pc = ParallelContext(pp=2)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=128, attn_backend="sdpa",
    )  # fmt: skip
    names = llama_block_names(config)
    half = 1 + layers // 2  # embedding + half the layers | the rest + norm, head, loss
    mine = names[:half] if pc.pp_rank == 0 else names[half:]
    stage = build_llama_stage(config, pc, mine, seed=0)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        ids = torch.randint(0, 512, (2, 129), generator=gen)
        batches.append(
            {"input_ids": ids[:, :-1], "label_ids": ids[:, 1:],
             "label_mask": torch.ones(2, 128, dtype=torch.bool)}
        )  # fmt: skip
    out = {}
    for engine in ("1f1b", "zb-h1"):
        res = run_pipeline_step(engine, stage, batches, pc, track_activations=True)
        out[engine + "_bytes"] = res.stats.peak_saved_activation_bytes
        stage.zero_grad(set_to_none=True)
    times = {"1f1b": [], "zb-h1": []}
    for _ in range(steps):  # alternate engines so load changes hit both alike
        for engine in times:
            dist.barrier()
            t0 = time.perf_counter()
            run_pipeline_step(engine, stage, batches, pc)
            dist.barrier()
            times[engine].append(time.perf_counter() - t0)
            stage.zero_grad(set_to_none=True)
    out.update({k + "_s": statistics.median(v) for k, v in times.items()})
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
    print("\npp=2, m=8, equal stages, CPU (gloo, 1 thread per stage)")
    for rank, r in enumerate(results):
        ratio = r["zb-h1_bytes"] / r["1f1b_bytes"]
        print(
            f"stage {rank}: peak saved activations 1f1b {r['1f1b_bytes'] / 2**20:.1f} MiB, "
            f"zb-h1 {r['zb-h1_bytes'] / 2**20:.1f} MiB (x{ratio:.2f})"
        )
    r = results[0]
    print(
        f"step time: 1f1b {r['1f1b_s'] * 1e3:.0f} ms, zb-h1 {r['zb-h1_s'] * 1e3:.0f} ms, "
        f"ratio zb-h1/1f1b {r['zb-h1_s'] / r['1f1b_s']:.3f}"
    )


if __name__ == "__main__":
    main()
