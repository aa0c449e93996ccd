"""The planner's predictions next to published throughput figures of other frameworks.

1. TorchTitan's benchmarks/llama3_h100_202412_torchtitan.md (Tables 1 and 3: Llama 3.1 8B,
   FSDP, bf16, local batch 2, sequence 8192, selective activation checkpointing, on 8 and 128
   H100s of 96 GB HBM2e at 500 W). Ours: the same model as a config (ZeRO-3 over dp = FSDP,
   bf16, mbs 2, m 1), predicted with recompute off and full (selective checkpointing sits
   between): tokens/s per GPU and memory.
2. Megatron-LM's README throughput table (images/model_table.png in NVIDIA/Megatron-LM: GPT
   models of 1.7B-462B, vocabulary 131,072, sequence 4,096, on 48-6,144 H100s, with tp, pp and
   dp = 48, the global batch, per-GPU teraFLOP/s and MFU). Ours: each model as a Llama config
   of the same size (MHA, SwiGLU of 8h/3 rounded to 128, the FLOPs of GELU's 4h), bf16, the
   same tp (sequence parallel), pp and dp, ZeRO-1 (Megatron's distributed optimizer),
   micro-batch 1 (not published), the rest of the global batch as accumulation, recompute
   off, pp engine 1f1b and interleaved-1f1b (2 virtual stages) where the checks accept it.

Both on the `h100` row: peak FLOP/s, memory and bandwidths from NVIDIA's H100 SXM5 sheet;
`achievable` 0.45, `link_efficiency` 0.75 and `reserved_bytes` assumed. For Megatron a
second prediction fits `achievable` on one row (the one the model predicts most
compute-bound) and predicts the others with it. Prints Markdown tables with a ratio per row.

    .venv/bin/python bench/plan_published.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.train.test_plan_memory import raw  # noqa: E402

LLAMA31_8B = dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, vocab=128256, seq=8192)
# (table, GPUs, technique, TPS/GPU, memory GiB), bf16 rows only (Float8 is not modelled)
PUBLISHED = [
    ("1", 8, "FSDP", 5762, 82.4),
    ("1", 8, "FSDP + torch.compile", 6667, 77.0),
    ("3", 128, "FSDP", 5605, 67.0),
    ("3", 128, "FSDP + torch.compile", 6514, 62.0),
]


def torchtitan() -> None:
    from nanotron_train.config import config_from_dict
    from nanotron_train.plan.devices import DEVICES
    from nanotron_train.plan.enumerate import predict

    print("| table | GPUs | TorchTitan | TPS/GPU | GiB | ours, recompute | TPS/GPU | GiB | "
          "TPS ratio | GiB ratio |\n|---|---:|---|---:|---:|---|---:|---:|---:|---:|")  # fmt: skip
    for table, gpus, technique, tps, gib in PUBLISHED:
        for recompute in (False, True):
            data = raw({**LLAMA31_8B, "dp": gpus, "zero": 3, "mbs": 2, "m": 1,
                        "recompute": recompute})  # fmt: skip
            data["model"]["dtype"] = "bfloat16"
            data["model"]["model_config"]["rope_theta"] = 500000.0
            cfg = config_from_dict(data, "published", world_size=None)
            p = predict(cfg, DEVICES["h100"], gpus, 8)
            ours, mem = p.tokens_per_s_per_device, p.memory.total / 2**30
            print(f"| {table} | {gpus} | {technique} | {tps:,} | {gib} | "
                  f"{'full' if recompute else 'off'} | {ours:,.0f} | {mem:.1f} | "
                  f"{ours / tps:.2f} | {mem / gib:.2f} |")  # fmt: skip


# Megatron-LM README, images/model_table.png (vocabulary 131,072, sequence 4,096):
# (size, heads, hidden, layers, tp, pp, dp, GPUs, global batch, per-GPU TFLOP/s, MFU)
MEGATRON = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47),
]
MEGATRON_VOCAB, MEGATRON_SEQ = 131072, 4096


def megatron_flops_per_token(h: int, layers: int) -> float:
    """Megatron's model FLOPs per token (Narayanan et al. 2021, without recompute):
    72 l h^2 (1 + s / 6h + V / 12 l h)."""
    s, v = MEGATRON_SEQ, MEGATRON_VOCAB
    return 72 * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))


def megatron_config(row, engine: str):
    from nanotron_train.config import config_from_dict
    from nanotron_train.config.errors import ConfigError

    _, heads, h, layers, tp, pp, dp, _, batch, _, _ = row
    inter = round(8 * h / 3 / 128) * 128  # SwiGLU's 3 matrices = GELU's 2 of 4h
    data = raw({"hidden": h, "inter": inter, "layers": layers, "heads": heads, "kv": heads,
                "vocab": MEGATRON_VOCAB, "seq": MEGATRON_SEQ, "dp": dp, "tp": tp, "pp": pp,
                "engine": engine, "v": 2 if engine == "interleaved-1f1b" else 1,
                "mode": "REDUCE_SCATTER" if tp > 1 else "ALL_REDUCE", "zero": 1, "mbs": 1,
                "m": batch // dp})  # fmt: skip
    data["model"]["dtype"] = "bfloat16"
    try:
        return config_from_dict(data, "megatron", world_size=None)
    except ConfigError:
        return None  # e.g. layers that interleaved chunks cannot split evenly


def _predict(row, engine: str, device):
    from nanotron_train.plan.enumerate import predict

    cfg = megatron_config(row, engine)
    return None if cfg is None else predict(cfg, device, row[7], 8)


def _compute_share(row, device) -> float:
    t = _predict(row, "1f1b", device).time
    return t.compute / t.total


def _fit_achievable(row, device) -> float:
    """`achievable` that makes the row's predicted rate (in Megatron's FLOPs) theirs, within
    [0.05, 1] (1: the whole peak)."""
    import dataclasses

    _, _, h, layers, _, _, _, _, _, tflops, _ = row
    lo, hi = 0.05, 1.0
    for _ in range(40):  # bisection: the predicted rate grows with achievable
        mid = (lo + hi) / 2
        p = _predict(row, "1f1b", dataclasses.replace(device, achievable=mid))
        rate = p.tokens_per_s_per_device * megatron_flops_per_token(h, layers) / 1e12
        lo, hi = (mid, hi) if rate < tflops else (lo, mid)
    return (lo + hi) / 2


def megatron() -> None:
    import dataclasses

    from nanotron_models.families import family_of
    from nanotron_train.plan.devices import DEVICES

    h100 = DEVICES["h100"]
    # fitted on the row the model predicts most compute-bound: its rate says most about the
    # achievable FLOP/s and least about the communication model
    fit_row = max(MEGATRON, key=lambda row: _compute_share(row, h100))
    fitted = dataclasses.replace(h100, achievable=_fit_achievable(fit_row, h100))
    print(f"achievable fitted on the {fit_row[0]} row (1f1b, predicted compute share "
          f"{_compute_share(fit_row, h100):.2f}): {fitted.achievable:.3f} "
          f"(assumed: {h100.achievable})\n")  # fmt: skip
    print("| model | GPUs | tp | pp | dp | batch | Megatron TFLOP/s/GPU | MFU | tokens/s/GPU | "
          "ours, engine | tokens/s/GPU | ratio | fitted tokens/s/GPU | ratio | ours GiB (fits 80 GB) "
          "| FLOPs/token ours / Megatron |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---:|")  # fmt: skip
    for row in MEGATRON:
        size, _, h, layers, tp, pp, dp, gpus, batch, tflops, mfu = row
        flops = megatron_flops_per_token(h, layers)
        theirs = tflops * 1e12 / flops
        for engine in ("1f1b", "interleaved-1f1b") if pp > 1 else ("1f1b",):
            p, f = _predict(row, engine, h100), _predict(row, engine, fitted)
            if p is None:  # refused by the config checks
                continue
            mc = p.cfg.model.model_config
            ours_flops = family_of(mc).training_flops_per_token(mc, MEGATRON_SEQ)
            ours, fit = p.tokens_per_s_per_device, f.tokens_per_s_per_device
            gib = f"{p.memory.total / 2**30:.0f} ({'yes' if p.fits else 'no'})"
            print(f"| {size} | {gpus:,} | {tp} | {pp} | {dp} | {batch:,} | {tflops} | "
                  f"{mfu:.0%} | {theirs:,.0f} | {engine if pp > 1 else '-'} | {ours:,.0f} | "
                  f"{ours / theirs:.2f} | {fit:,.0f} | {fit / theirs:.2f} | {gib} | "
                  f"{ours_flops / flops:.3f} |")  # fmt: skip


def main() -> None:
    torchtitan()
    print()
    megatron()


if __name__ == "__main__":
    main()
