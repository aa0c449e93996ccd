"""One-GPU benchmark driven by bench/gpu.sh: a ~1B Llama in bf16 with fp32 gradient
accumulation and fp32 master weights, sequence 2048, synthetic tokens, through our trainer.

Per run (SDPA; flash-attn too when importable; each without and with recompute_layer) it
prints tokens/s, model TFLOP/s per GPU, MFU against 989 TFLOP/s (H100/H200 dense bf16) and
the peak memory; medians over the steps after the warm-up. Then it counts the bytes our
tensor-parallel collectives move per step (a 2-rank gloo run on the CPU, collectives wrapped)
against the formula. Results go to $OUT/gpu_bench.json when OUT is set.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import time

import torch

PEAK_TFLOPS = 989.0
STEPS, WARMUP = 30, 5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_config(attn: str, recompute: bool, steps: int) -> object:
    from nanotron_train.config import load_config

    return load_config(
        os.path.join(ROOT, "configs", "llama-1b-gpu.yaml"),
        [
            f"model.model_config.attn_backend={attn}",
            f"parallelism.recompute_layer={'true' if recompute else 'false'}",
            "model.dtype=bfloat16",
            "optimizer.accumulate_grad_in_fp32=true",
            "tokens.sequence_length=2048",
            "tokens.micro_batch_size=4",
            "tokens.batch_accumulation_per_replica=4",
            f"tokens.train_steps={steps}",
            "checkpoints.checkpoints_path=null",
            "logging.metrics_file=null",
            "logging.iteration_step_info_interval=1",
        ],
        world_size=1,
    )


def run_one(attn: str, recompute: bool) -> dict:
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    cfg = gpu_config(attn, recompute, STEPS)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    pc = ParallelContext()
    try:
        trainer = Trainer(cfg, pc, stream=io.StringIO())
        records: list[dict] = []
        trainer.train(on_record=records.append)
    finally:
        pc.destroy()
    seq = cfg.tokens.sequence_length
    tokens = cfg.global_batch_size * seq
    times = [r["time_per_iteration_ms"] / 1000 for r in records[WARMUP:]]
    sec = statistics.median(times)
    flops = trainer.flops_per_token * tokens
    tflops = flops / sec / 1e12
    out = {
        "attn": attn,
        "recompute_layer": recompute,
        "tokens_per_step": tokens,
        "step_s": sec,
        "tokens_per_s": tokens / sec,
        "tflops_per_gpu": tflops,
        "mfu": tflops / PEAK_TFLOPS,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss_first": records[0]["lm_loss"],
        "loss_last": records[-1]["lm_loss"],
    }
    print(
        f"{attn:<10} recompute={str(recompute):<5} {out['tokens_per_s']:>9.0f} tok/s "
        f"{tflops:>6.1f} TFLOP/s  MFU {100 * out['mfu']:>5.1f}%  "
        f"peak {out['peak_memory_gib']:.1f} GiB  loss {out['loss_first']:.3f} -> "
        f"{out['loss_last']:.3f}",
        flush=True,
    )
    return out


def tp_bytes_rank(layers: int, hidden: int, seq: int, mbs: int, m: int) -> dict:
    """On each of 2 gloo ranks: one training step at tp=2 (ALL_REDUCE), counting the bytes
    handed to collectives on the tp group."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    counted = {"bytes": 0}
    pc = ParallelContext(tp=2)

    def wrap(fn, arg):
        def inner(*args, **kwargs):
            if kwargs.get("group") is pc.tp_group:
                t = args[arg] if len(args) > arg else kwargs.get("tensor")
                counted["bytes"] += t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return inner

    dist.all_reduce = wrap(dist.all_reduce, 0)
    cfg = config_from_dict(
        {
            "parallelism": {"tp": 2, "tp_mode": "ALL_REDUCE"},
            "model": {
                "model_config": {
                    "hidden_size": hidden,
                    "intermediate_size": 2 * hidden,
                    "num_hidden_layers": layers,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "vocab_size": 512,
                    "max_position_embeddings": seq,
                },
                "dtype": "float32",  # the byte formula counts 4-byte activations
            },  # fmt: skip
            "tokens": {
                "sequence_length": seq,
                "micro_batch_size": mbs,
                "batch_accumulation_per_replica": m,
                "train_steps": 1,
            },  # fmt: skip
            "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-3}},
        },
        "gpu_bench",
    )
    try:
        Trainer(cfg, pc, stream=io.StringIO()).train()
    finally:
        pc.destroy()
    return counted


def tp_bytes() -> dict:
    """Counted tp all-reduce bytes of one step vs (4 L + 2) * s * b * h * 4 bytes per
    micro-batch: per layer two forward all-reduces (attention and MLP outputs) and two backward
    ones (gradients of the qkv and gate-up inputs), plus the embedding's forward and the
    lm_head input's backward; the cross-entropy's three [s, b] reductions come on top."""
    from nanotron_parallel.testing import run_distributed

    layers, hidden, seq, mbs, m = 4, 256, 128, 2, 2
    res = run_distributed(tp_bytes_rank, 2, layers, hidden, seq, mbs, m, timeout=300)
    per_mb = (4 * layers + 2) * seq * mbs * hidden * 4 + 3 * seq * mbs * 4
    theory = per_mb * m
    counted = res[0]["bytes"]
    out = {"counted_bytes_per_step": counted, "theoretical_bytes_per_step": theory,
           "ratio": counted / theory}  # fmt: skip
    print(f"tp=2 all-reduce bytes per step: counted {counted}, formula {theory}, "
          f"ratio {out['ratio']:.4f}")  # fmt: skip
    return out


def main() -> int:
    results: dict = {"date": time.strftime("%Y-%m-%d"), "peak_tflops": PEAK_TFLOPS, "runs": []}
    if torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name(0)
        print(f"device: {results['device']}, torch {torch.__version__}", flush=True)
        from nanotron_models.attention import flash_attn_available

        attns = ["sdpa"] + (["flash_attn"] if flash_attn_available() else [])
        for attn in attns:
            for recompute in (False, True):
                results["runs"].append(run_one(attn, recompute))
    else:
        print("no CUDA device: skipping the training runs", flush=True)
    results["tp_bytes"] = tp_bytes()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_bench.json"), "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {os.path.join(out, 'gpu_bench.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
