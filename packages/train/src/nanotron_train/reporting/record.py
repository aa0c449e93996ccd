"""The metrics record of a logged step: throughput, TFLOP/s and MFU from what a step measured.

The record (one JSON object per logged step, floats at full precision) has: step,
consumed_tokens, lm_loss, grad_norm, lr, tokens_per_sec, tokens_per_sec_per_gpu,
time_per_iteration_ms, model_tflops_per_gpu, mfu (null unless the device's peak is known),
memory (peak bytes: CUDA allocated, or the process's max RSS on CPU), global_batch_size; and
val_loss, val_ppl on the steps that evaluate (every tokens.val_check_interval and the last).
The sinks (`metrics.py`) add the run and attempt ids to the JSON lines file's copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepMeasure:
    step: int
    consumed_tokens: int
    lm_loss: float
    grad_norm: float | None
    lr: float
    seconds: float
    tokens_in_step: int


def make_record(
    m: StepMeasure,
    world_size: int,
    flops_per_token: float,
    peak_tflops: float | None,
    memory: int,
    global_batch_size: int,
) -> dict[str, Any]:
    tokens_per_sec = m.tokens_in_step / m.seconds if m.seconds > 0 else float("nan")
    per_gpu = tokens_per_sec / world_size
    tflops = per_gpu * flops_per_token / 1e12
    return {
        "step": m.step,
        "consumed_tokens": m.consumed_tokens,
        "lm_loss": m.lm_loss,
        "grad_norm": m.grad_norm,
        "lr": m.lr,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_gpu": per_gpu,
        "time_per_iteration_ms": m.seconds * 1000.0,
        "model_tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "memory": memory,
        "global_batch_size": global_batch_size,
    }


class StepTimer:
    """The mean time per step since the last `restart`: the steps between two records are
    timed together, so that an unlogged step never waits for the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.restart()

    def restart(self) -> None:
        self.since, self.steps = time.perf_counter(), 0

    def count(self) -> None:
        self.steps += 1

    def seconds_per_step(self) -> float:
        """Waits for the device (CUDA) so that the steps' queued work is in the time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - self.since) / self.steps
