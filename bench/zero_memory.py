"""Parameter + gradient + optimizer bytes per rank at ZeRO stages 0-3, next to the ZeRO formula.

The same Llama trains two steps at dp=2 and dp=4 under each `optimizer.zero_stage`; after the
step each rank's bytes are measured from the tensors it holds (`grads.memory_bytes()`: every
parameter and gradient storage once, released ones count 0; `optimizer.state_bytes()`: Adam
moments and fp32 master copies). The largest rank is reported, with the ZeRO paper's formula
(Rajbhandari et al., 2020) adapted to how this project keeps a model of P parameters:

  fp32 weights (default): p = 4 bytes of parameter, g = 4 of fp32 gradient, K = 8 of Adam
                          moments per parameter (the fp32 master is the parameter itself)
  --dtype bfloat16:       p = 2, g = 4 (gradients accumulate in fp32), K = 12 (fp32 master
                          + moments), the paper's mixed-precision K

  stage 0: (p + g + K) P      stage 1: (p + g + K/dp) P
  stage 2: (p + (g + K)/dp) P stage 3: (p + g + K) P / dp

ratio = measured / formula (the excess is the padding of each bucket to dp equal chunks).
Under ZeRO-3 the parameters of a block are also held while it runs: `peak gathered` is the
most parameter bytes gathered at once during the steps (the running block and the prefetched
next one), printed in units of the largest block; the aim is after-step bytes within 10% of
the formula and the peak within it plus about one block (two with the prefetch).

    .venv/bin/python bench/zero_memory.py [--hidden 256 --layers 8 --vocab 4096 --seq 64]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import io

import torch

from nanotron_parallel.testing import run_distributed

BYTES = {"float32": (4, 4, 8), "bfloat16": (2, 4, 12)}  # p, g, K per parameter


def bench_config(dp: int, zero: int, args) -> dict:
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
            "dtype": args.dtype,
        },
        "tokens": {"sequence_length": args.seq, "micro_batch_size": 1,
                   "batch_accumulation_per_replica": 2, "train_steps": 2},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-4}, "clip_grad": 1.0,
                      "weight_decay": 0.01, "accumulate_grad_in_fp32": True, "zero_stage": zero},
        "logging": {"iteration_step_info_interval": 10**6},
    }  # fmt: skip


def measure(dp: int, args) -> list[dict]:
    """On every rank: each zero stage in turn, two steps, then the bytes held."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for zero in range(4):
            cfg = config_from_dict(bench_config(dp, zero, args), "bench", world_size=None)
            pc = ParallelContext(dp=dp, tp=1, pp=1)
            try:
                trainer = Trainer(cfg, pc, stream=io.StringIO())
                for _ in range(2):
                    trainer.train_step()
                grads = trainer.grads
                held = grads.memory_bytes()
                held["optimizer"] = trainer.state.optimizer.state_bytes()
                held["n_params"] = sum(p.numel() for p in grads.params)
                held["peak_gathered"] = getattr(grads, "peak_gathered_bytes", 0)
                held["largest_block"] = max(
                    (b.param_full.nbytes for b in grads.buckets if hasattr(b, "param_full")),
                    default=0,
                )
                trainer.close()
            finally:
                dist.barrier()
                pc.destroy()
            out.append(held)
    return out


def formula(zero: int, dp: int, n: int, dtype: str) -> float:
    p, g, k = BYTES[dtype]
    per_param = {0: p + g + k, 1: p + g + k / dp, 2: p + (g + k) / dp, 3: (p + g + k) / dp}
    return per_param[zero] * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(BYTES), default="float32")
    args = parser.parse_args()
    p, g, k = BYTES[args.dtype]
    print(f"{args.dtype} weights: p={p} g={g} K={k} bytes per parameter; MiB per rank after a step")
    header = (
        f"{'dp':>2} {'zero':>4} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} "
        f"{'formula':>8} {'ratio':>6} {'vs zero0':>8}  peak gathered (ZeRO-3)"
    )
    print(header)
    mib = 2.0**20
    for dp in (2, 4):
        ranks = run_distributed(measure, dp, dp, args, timeout=900)
        zero0 = None
        for zero in range(4):
            rows = [r[zero] for r in ranks]
            worst = max(rows, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
            total = worst["params"] + worst["grads"] + worst["optimizer"]
            zero0 = total if zero == 0 else zero0
            want = formula(zero, dp, worst["n_params"], args.dtype)
            extra = ""
            if zero == 3:
                peak, block = worst["peak_gathered"], worst["largest_block"]
                extra = (
                    f"{peak / mib:.2f} MiB = {peak / block:.2f} x the largest block; "
                    f"(after-step + peak) / (formula + one block) = "
                    f"{(total + peak) / (want + block):.3f}"
                )
            print(
                f"{dp:>2} {zero:>4} {worst['params'] / mib:8.2f} {worst['grads'] / mib:8.2f} "
                f"{worst['optimizer'] / mib:8.2f} {total / mib:8.2f} {want / mib:8.2f} "
                f"{total / want:6.3f} {total / zero0:8.3f}  {extra}"
            )


if __name__ == "__main__":
    main()
