"""`general.benchmark_csv_path`: one throughput row per run appended to a CSV file.

The columns follow Nanotron's benchmark table (same names where the quantity is the same), so
sweeps of both can be read together. Rates are the mean over the run's steps after the first
(compilation and warm-up). Several jobs may append to one file: the append holds an exclusive
lock and the header is written only into an empty file.
"""

from __future__ import annotations

import csv
import fcntl
import io
import os
from pathlib import Path
from typing import Any

COLUMNS = (
    "job_id", "name", "nodes", "seq_len", "mbs", "batch_accum", "gbs", "mTFLOPs", "tok/s/gpu",
    "Mem Alloc (GB)", "dp", "pp", "tp", "pp_engine", "tp_mode", "tp_async_comm",
    "recompute_layer", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
    "dtype", "zero_stage", "steps", "mfu",
)  # fmt: skip


def benchmark_row(cfg, records: list[dict[str, Any]], world_size: int, local_world: int) -> dict:
    timed = records[1:] or records
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    par, mc = cfg.parallelism, cfg.model.model_config
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "job_id": os.environ.get("SLURM_JOB_ID", "N/A"),
        "name": cfg.general.run,
        "nodes": -(-world_size // max(local_world, 1)),
        "seq_len": cfg.tokens.sequence_length,
        "mbs": cfg.tokens.micro_batch_size,
        "batch_accum": cfg.tokens.batch_accumulation_per_replica,
        "gbs": cfg.global_batch_size,
        "mTFLOPs": f"{mean('model_tflops_per_gpu'):.2f}",
        "tok/s/gpu": f"{mean('tokens_per_sec_per_gpu'):.2f}",
        "Mem Alloc (GB)": f"{max(r['memory'] for r in records) / 1024**3:.2f}",
        "dp": par.dp, "pp": par.pp, "tp": par.tp,
        "pp_engine": par.pp_engine, "tp_mode": par.tp_mode,
        "tp_async_comm": par.tp_linear_async_communication,
        "recompute_layer": par.recompute_layer,
        "hidden_size": mc.hidden_size, "num_layers": mc.num_hidden_layers,
        # Nanotron's columns; a family without attention heads leaves them empty
        "num_heads": getattr(mc, "num_attention_heads", ""),
        "num_kv_heads": getattr(mc, "num_key_value_heads", ""),
        "vocab_size": mc.vocab_size, "dtype": cfg.model.dtype,
        "zero_stage": cfg.optimizer.zero_stage, "steps": len(records),
        "mfu": f"{sum(mfu) / len(mfu):.4f}" if mfu else "",
    }  # fmt: skip


def append_row(path: str | os.PathLike, row: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a", newline="") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            buf = io.StringIO()
            writer = csv.DictWriter(buf, fieldnames=COLUMNS)
            if f.tell() == 0:
                writer.writeheader()
            writer.writerow(row)
            f.write(buf.getvalue())  # one write: a reader never sees half a row
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
