"""Nanotron's learning-rate schedule: warm-up, decay, then constant.

Step numbers are 1-based optimizer steps (the step being taken). Warm-up over
`lr_warmup_steps` is linear (lr * step / warmup, so step `warmup` reaches the peak) or constant;
decay runs over `lr_decay_steps` starting after `lr_decay_starting_step` (default: the end of
warm-up) down to `min_decay_lr` (default: no decay), linear, cosine or 1-sqrt; then constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LRSchedule:
    learning_rate: float
    warmup_steps: int
    warmup_style: str  # "linear" | "constant"
    decay_style: str  # "linear" | "cosine" | "1-sqrt"
    decay_start: int
    decay_steps: int
    min_lr: float

    def __call__(self, step: int) -> float:
        peak, low = self.learning_rate, self.min_lr
        if step <= self.warmup_steps:
            if self.warmup_style == "constant":
                return peak
            return peak * step / self.warmup_steps
        if step <= self.decay_start:
            return peak
        progress = (step - self.decay_start) / max(self.decay_steps, 1)
        if progress >= 1.0:
            return low
        if self.decay_style == "linear":
            factor = 1.0 - progress
        elif self.decay_style == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # "1-sqrt"
            factor = 1.0 - math.sqrt(progress)
        return low + (peak - low) * factor


def build_lr_schedule(lrs, train_steps: int) -> LRSchedule:
    """From the config's `optimizer.learning_rate_scheduler` section (LRSchedulerArgs)."""
    start = (
        lrs.lr_decay_starting_step
        if lrs.lr_decay_starting_step is not None
        else lrs.lr_warmup_steps
    )
    steps = lrs.lr_decay_steps if lrs.lr_decay_steps is not None else max(train_steps - start, 1)
    low = lrs.min_decay_lr if lrs.min_decay_lr is not None else lrs.learning_rate
    return LRSchedule(
        learning_rate=lrs.learning_rate,
        warmup_steps=lrs.lr_warmup_steps,
        warmup_style=lrs.lr_warmup_style,
        decay_style=lrs.lr_decay_style,
        decay_start=start,
        decay_steps=steps,
        min_lr=low,
    )
