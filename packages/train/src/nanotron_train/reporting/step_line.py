"""The Nanotron-style line a logged step prints on stdout (`iteration: 5 / 100 | ...`)."""

from __future__ import annotations

from typing import Any

from nanotron_train.reporting.sizes import format_bytes


def _human(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_line(rec: dict[str, Any], train_steps: int) -> str:
    parts = [
        f"iteration: {rec['step']} / {train_steps}",
        f"consumed_tokens: {_human(rec['consumed_tokens'])}",
        f"elapsed_time_per_iteration_ms: {_human(rec['time_per_iteration_ms'])}",
        f"tokens_per_sec: {_human(rec['tokens_per_sec'])}",
        f"tokens_per_sec_per_gpu: {_human(rec['tokens_per_sec_per_gpu'])}",
        f"global_batch_size: {rec['global_batch_size']}",
        f"lm_loss: {rec['lm_loss']:.4g}",
        f"lr: {rec['lr']:.4g}",
        f"model_tflops_per_gpu: {rec['model_tflops_per_gpu']:.3g}",
    ]
    if "z_loss" in rec:
        parts.insert(7, f"z_loss: {rec['z_loss']:.4g}")
    if "labelled_tokens_per_sec" in rec:  # SFT: the tokens trained on (the loss is their mean)
        parts.insert(5, f"labelled_tokens_per_sec: {_human(rec['labelled_tokens_per_sec'])}")
    if "moe/aux_loss" in rec:  # a MoE model (reporting/moe_metrics.py)
        parts.append(f"moe_aux_loss: {rec['moe/aux_loss']:.4g}")
        if "moe/z_loss" in rec:
            parts.append(f"moe_z_loss: {rec['moe/z_loss']:.4g}")
        parts.append(f"moe_load_imbalance: {rec['moe/load_imbalance']:.3g}")
    if rec["grad_norm"] is not None:
        parts.append(f"grad_norm: {rec['grad_norm']:.4g}")
    if "val_loss" in rec:  # an evaluation step (eval/evaluation.py)
        parts.append(f"val_loss: {rec['val_loss']:.4g}")
        parts.append(f"val_ppl: {rec['val_ppl']:.4g}")
    if rec["mfu"] is not None:
        parts.append(f"mfu: {100 * rec['mfu']:.2f}%")
    parts.append(f"memory: {format_bytes(rec['memory'])}")
    return " | ".join(parts)
