"""Host-side costs and kernel choices of a training step, each against its absence in one run.

- Gradient-accumulation fusion: the linears' weight gradients computed into the gradient
  buffers by their backward's matmul (tensor_parallel/weight_grad.py), against autograd's
  way (a gradient tensor, a transposing copy, a separate add). One process, the two
  alternated step by step (`fuse_grad_accumulation` toggled on the linear class).
- The same for the two vocab-sized tables: the embedding's rows added into its buffer, and
  the fused lm_head-and-loss's ready gradient scaled into its buffer, against autograd's
  table-sized gradients (a zero fill, an in-place scaling, a copy or add). Alternated step
  by step (`fuse_grad_accumulation` toggled on the two layers).
- oneDNN GEMMs: the linears' forward and input-gradient GEMMs through oneDNN's matmul
  (tensor_parallel/cpu_gemm.py) against the BLAS behind `F.linear`, alternated step by step
  (`cpu_gemm.enabled` toggled).
- Kept host memory: the trainer's glibc thresholds (nanotron_train/host_memory.py) against
  glibc's defaults, in fresh processes alternated (`--processes` pairs; the machine's speed
  drifts between minutes): step time and minor page faults per step, medians over processes.

The model is the peer comparison's (hidden 512, 8 layers, GQA 8/4, vocab 8192, sequence 256,
2 micro-batches of 2, fp32, AdamW with torch's per-tensor arithmetic, no clipping). Medians
over the timed steps; the ratio is with / without (below 1: the feature is faster).

    .venv/bin/python bench/step_costs.py [--steps 10] [--warmup 3] [--threads 2] [--processes 3]
"""

from __future__ import annotations

import argparse
import io
import resource
import statistics
import time

import torch

from nanotron_parallel.testing import run_distributed


def bench_config() -> dict:
    return {
        "general": {"seed": 1},
        "parallelism": {"dp": 1, "tp": 1, "pp": 1, "pp_engine": "1f1b"},
        "model": {
            "model_config": {
                "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8192,
                "max_position_embeddings": 256, "tie_word_embeddings": False,
            },
            "dtype": "float32",
        },
        "tokens": {"sequence_length": 256, "micro_batch_size": 2,
                   "batch_accumulation_per_replica": 2, "train_steps": 10**6},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 3e-4}, "clip_grad": None,
                      "weight_decay": 0.01, "zero_stage": 0},
        "logging": {"iteration_step_info_interval": 1},
    }  # fmt: skip


def _trainer(keep_memory: bool):
    import nanotron_train.trainer as trainer_mod
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict

    if not keep_memory:  # bench only: the process keeps glibc's defaults
        trainer_mod.keep_freed_host_memory = lambda: False
    pc = ParallelContext()
    cfg = config_from_dict(bench_config(), "bench", world_size=None)
    return trainer_mod.Trainer(cfg, pc, stream=io.StringIO()), pc


def _step(tr) -> tuple[float, int]:
    """Seconds and minor page faults of one logged step (its record included)."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    tr.step_record(tr.train_step(), 1.0)
    seconds = time.perf_counter() - t
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def _fuse_linears(model, on: bool) -> None:
    from nanotron_parallel.tensor_parallel.layers import _TPLinearBase

    _TPLinearBase.fuse_grad_accumulation = on


def _fuse_tables(model, on: bool) -> None:
    model.embedding.fuse_grad_accumulation = on
    model.lm_head.fuse_grad_accumulation = on


def _onednn_gemms(model, on: bool) -> None:
    from nanotron_parallel.tensor_parallel import cpu_gemm

    cpu_gemm.enabled = on


TOGGLES = {"linears": _fuse_linears, "tables": _fuse_tables, "onednn": _onednn_gemms}


def measure_fusion(which: str, threads: int, warmup: int, steps: int) -> dict:
    toggle = TOGGLES[which]
    torch.set_num_threads(threads)
    tr, pc = _trainer(keep_memory=True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(warmup + 2 * steps):
        fused = i % 2 == 0
        toggle(tr.state.model, fused)
        seconds, _ = _step(tr)
        if i >= warmup:
            times[fused].append(seconds)
    toggle(tr.state.model, True)
    tr.close()
    pc.destroy()
    return {k: statistics.median(v) for k, v in times.items()}


def measure_memory(keep: bool, threads: int, warmup: int, steps: int) -> tuple[float, float]:
    torch.set_num_threads(threads)
    tr, pc = _trainer(keep_memory=keep)
    got = [_step(tr) for _ in range(warmup + steps)][warmup:]
    tr.close()
    pc.destroy()
    return statistics.median(s for s, _ in got), statistics.median(f for _, f in got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--processes", type=int, default=3, help="pairs of memory processes")
    args = ap.parse_args()
    a = (args.threads, args.warmup, args.steps)
    for which, name in (("linears", "the linears"), ("tables", "embedding and lm_head")):
        fusion = run_distributed(measure_fusion, 1, which, *a, timeout=1800)[0]
        print(
            f"gradient-accumulation fusion, {name}: step {1e3 * fusion[True]:.1f} ms fused, "
            f"{1e3 * fusion[False]:.1f} ms through autograd, "
            f"ratio {fusion[True] / fusion[False]:.3f}"
        )
    gemms = run_distributed(measure_fusion, 1, "onednn", *a, timeout=1800)[0]
    print(
        f"oneDNN GEMMs (forward and input gradient): step {1e3 * gemms[True]:.1f} ms, "
        f"{1e3 * gemms[False]:.1f} ms through the BLAS, ratio {gemms[True] / gemms[False]:.3f}"
    )
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(2 * args.processes):  # fresh processes, alternated: kept, default, ...
        keep = i % 2 == 0
        runs[keep].append(run_distributed(measure_memory, 1, keep, *a, timeout=1800)[0])
    kept, default = (tuple(statistics.median(x) for x in zip(*runs[k])) for k in (True, False))
    print(
        f"kept host memory: step {1e3 * kept[0]:.1f} ms with {kept[1]:.0f} page faults, "
        f"glibc defaults {1e3 * default[0]:.1f} ms with {default[1]:.0f}, "
        f"ratio {kept[0] / default[0]:.3f}"
    )


if __name__ == "__main__":
    main()
