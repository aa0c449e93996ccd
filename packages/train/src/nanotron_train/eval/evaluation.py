"""Held-out evaluation: the token-weighted loss of the model over the fixed validation batches.

Every rank takes part, through the same pipeline / tp / dp machinery as training but with the
forward-only schedule (`nanotron_parallel.pipeline.run_forward_only`): no autograd graph, no
gradient, the model in eval mode. Each micro-batch's mean loss is weighted by its labelled
tokens on the device, and one all-reduce over pp and one over dp x cp at the end give every rank

    val_loss = sum of per-token losses / labelled tokens   (the whole validation set)
    val_ppl = exp(val_loss)

Nothing of the training state is touched: no RNG is drawn, the training data position is not
moved, the gradient buffers are not used; training continues bitwise as without evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.context_parallel import split_batch
from nanotron_parallel.pipeline import run_forward_only


@dataclass
class ValResult:
    loss: float
    ppl: float
    tokens: int

    def metrics(self) -> dict[str, float]:
        """The fields of the step record (stdout line, metrics file, TensorBoard, W&B,
        dashboard)."""
        return {"val_loss": self.loss, "val_ppl": self.ppl}


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class Evaluator:
    """Evaluates `model` (this rank's stage or chunks) on `data` (a ValidationData)."""

    def __init__(self, model: nn.Module, pc, engine: str, data: Any, interval: int = -1):
        self.model, self.pc, self.engine, self.data = model, pc, engine, data
        self.interval = interval  # tokens.val_check_interval; -1: only at the end

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.interval > 0 and step % self.interval == 0)

    def evaluate(self) -> ValResult:
        """Collective over every rank of the run."""
        pc, model = self.pc, self.model
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=pc.device)
        tokens = 0.0
        try:
            for micro_batches, weights in self.data.batches():
                on_device = [
                    {k: v.to(pc.device) for k, v in split_batch(mb, pc.cp_rank, pc.cp_size).items()}
                    for mb in micro_batches
                ]
                part = run_forward_only(self.engine, model, on_device, pc, weights)
                if part is not None:
                    loss_sum += part
                tokens += sum(weights)
        finally:
            model.train(was_training)
        # Only the last stage holds losses; counting its tokens alone keeps pp from multiplying.
        last = pc.is_last_stage
        totals = torch.stack(
            (loss_sum, torch.tensor(tokens if last else 0.0, dtype=torch.float64, device=pc.device))
        )
        if not last:
            totals[0] = 0.0
        if pc.pp_size > 1:
            dist.all_reduce(totals, group=pc.pp_group)
        if pc.dp_cp_size > 1:  # each cp rank counts every token and cp times its share
            dist.all_reduce(totals, group=pc.dp_cp_group)
        total_loss, total_tokens = totals.tolist()  # the one host sync of an evaluation
        loss = total_loss / total_tokens if total_tokens > 0 else math.nan
        return ValResult(loss, perplexity(loss), int(total_tokens))


def build_evaluator(cfg, pc, model: nn.Module, train_data: Any) -> Evaluator | None:
    """The run's Evaluator, or None when the config has no `validation` section."""
    from nanotron_train.data.source import build_validation_data

    data = build_validation_data(cfg, pc, train_data)
    if data is None:
        return None
    return Evaluator(model, pc, cfg.parallelism.pp_engine, data, cfg.tokens.val_check_interval)
