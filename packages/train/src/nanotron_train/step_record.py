"""The metrics record of a training step, made on every rank.

A step's loss is the last stage's, read on the host through a collective over pp and then
dp x cp, so every rank makes the record of the same steps (rank 0 alone logs it). The loss and
the gradient norm are the record's only host reads (tests/train/test_step_syncs.py counts
them), for a MoE model the packed expert statistics (reporting/moe_metrics.py), and on a
detail step the packed per-layer statistics (reporting/layer_stats.py); the non-finite check
runs on the loss and the norm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nanotron_models.config import DTYPES
from nanotron_models.families import family_of
from nanotron_parallel.pipeline import loss_on_all_pp_ranks
from nanotron_train.fault.nonfinite import stop as nonfinite_stop
from nanotron_train.model_factory import padded_model_config
from nanotron_train.reporting.device_peaks import device_peak_tflops, peak_memory_bytes
from nanotron_train.reporting.moe_metrics import MoEMetrics
from nanotron_train.reporting.record import StepMeasure, make_record
from nanotron_train.train_state import StepOutput


class StepRecorder:
    """Host reads of a step (mean loss, norm), its non-finite check, and its record.

    `model_args`: the config's model section; `fault`: the trainer's FaultTolerance;
    `grads`: its data-parallel gradients (where a stop finds the first non-finite one).
    """

    def __init__(self, model_args, global_batch_size: int, pc, fault, named_params, grads,
                 moe: MoEMetrics | None = None, layers=None):  # fmt: skip
        self.moe = moe  # expert load metrics (MoE models), one reduction per record
        self.layers = layers  # per-layer statistics (LayerStats), one reduction per detail step
        self.z_loss_enabled = model_args.model_config.z_loss_enabled
        self.global_batch_size = global_batch_size
        self.pc, self.fault, self.named_params, self.grads = pc, fault, named_params, grads
        self.model_config = padded_model_config(model_args)
        self.flops_per_token = family_of(self.model_config).training_flops_per_token
        self.peak_tflops = device_peak_tflops(pc.device, DTYPES[model_args.dtype])
        # SFT: labelled tokens of the steps since the last record (a device sum, read then)
        self.labelled: torch.Tensor | None = None
        self.labelled_steps = 0

    def add_labelled(self, count: torch.Tensor | None) -> None:
        """Count a step's labelled tokens (None: pretraining data, every token counts)."""
        if count is not None:
            self.labelled = count if self.labelled is None else self.labelled + count
            self.labelled_steps += 1

    def _labelled_metrics(self, seconds_per_step: float) -> dict[str, float]:
        """The trained (labelled) tokens per step and per second since the last record."""
        if self.labelled is None:
            return {}
        per_step = float(self.labelled) / self.labelled_steps
        self.labelled, self.labelled_steps = None, 0
        rate = per_step / seconds_per_step if seconds_per_step > 0 else float("nan")
        return {"labelled_tokens": per_step, "labelled_tokens_per_sec": rate}

    def global_mean_loss(self, last_stage_loss: torch.Tensor | None) -> float:
        """Mean over the global batch: the last stage's micro-batch mean, averaged over dp x cp
        (a cp rank's loss is cp times its share of the sequence's mean: see Loss)."""
        loss = loss_on_all_pp_ranks(last_stage_loss, self.pc)
        if self.pc.dp_cp_size > 1:
            dist.all_reduce(loss, group=self.pc.dp_cp_group)
        return float(loss) / self.pc.dp_cp_size

    def check_finite(self, step: int, loss: float, norm: float | None) -> str:
        """The non-finite policy's action for these values; raises NonFiniteStop under `stop`
        (naming the first parameter with a non-finite gradient)."""
        action = self.fault.nonfinite.check(loss, norm)
        if action == "stop":
            raise nonfinite_stop(
                step, loss, norm, self.named_params, self.pc, self.grads.local_grads
            )
        return action

    def record(
        self, out: StepOutput, seconds_per_step: float, consumed_tokens: int
    ) -> dict[str, Any]:
        """The record of step `out` (see Trainer.step_record)."""
        if out.host_values is not None:
            loss, norm = out.host_values
        else:
            loss, norm = self.global_mean_loss(out.loss), float(out.grad_norm)
        action = out.action
        if out.host_values is None:  # an unlogged step under `stop`: checked now
            action = self.check_finite(out.step, loss, norm)
        tokens = self.global_batch_size * out.sequence_length
        measure = StepMeasure(
            out.step, consumed_tokens, loss, norm, out.lr, seconds_per_step, tokens
        )
        record = make_record(
            measure,
            self.pc.world_size,
            self.flops_per_token(self.model_config, out.sequence_length),
            self.peak_tflops,
            peak_memory_bytes(self.pc.device),
            self.global_batch_size,
        )
        record.update(self._labelled_metrics(seconds_per_step))
        if self.z_loss_enabled:  # the same condition on every rank
            record["z_loss"] = self.global_mean_loss(out.z_loss)  # lm_loss includes it
        if self.moe is not None:  # the same condition on every rank
            record.update(self.moe.collect())
        if self.layers is not None:  # a detail step's statistics, else nothing
            record.update(self.layers.collect())
        return self.fault.annotate(record, action)
