"""The training loop, top to bottom.

config -> ParallelContext -> this rank's model stage -> gradient buffers, optimizer, LR
schedule -> data -> for each step: pipeline step over the micro-batches (the dp reduction starts
during the last backward), wait for it, tied-gradient sum, sequence-parallel norm gradients,
clip by the global norm, optimizer step (ZeRO-1: all-gather the parameters), metrics.

Everything a checkpoint needs lives in one `TrainState` (issue 7 adds save/load around it).
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from nanotron_models.blocks import Loss
from nanotron_models.flops import training_flops_per_token
from nanotron_parallel.clip import clip_grads, default_counts_in_norm, global_grad_norm
from nanotron_parallel.context import ParallelContext
from nanotron_parallel.data_parallel import DataParallelGrads
from nanotron_parallel.pipeline import loss_on_all_pp_ranks, run_pipeline_step
from nanotron_parallel.tied import tied_parameters
from nanotron_parallel.zero import all_gather_params, grad_norm_ranges, owned_ranges
from nanotron_train.benchmark_csv import append_row, benchmark_row
from nanotron_train.checkpoints.hooks import Checkpointing
from nanotron_train.config import Config
from nanotron_train.dashboard_sink import checkpoint_run_id
from nanotron_train.data_source import build_data
from nanotron_train.evaluation import build_evaluator
from nanotron_train.fault.nonfinite import stop as nonfinite_stop
from nanotron_train.fault.session import FaultTolerance
from nanotron_train.initial_weights import load_initial_weights
from nanotron_train.log_levels import configure_logging, prints_step_lines
from nanotron_train.lr_schedule import LRSchedule, build_lr_schedule
from nanotron_train.metrics import (
    MetricsLogger,
    StepMeasure,
    build_metrics_logger,
    device_peak_tflops,
    make_record,
    peak_memory_bytes,
)
from nanotron_train.model_factory import DTYPES, padded_model_config
from nanotron_train.optim import AdamWOnPieces, build_pieces, optimizer_kwargs
from nanotron_train.perf import build_train_model
from nanotron_train.profiling import StepProfiler
from nanotron_train.sanity import SanityCheckError, check_dp_replicas

BACKEND_TIMEOUT_MARGIN_S = 30.0


@dataclass
class TrainState:
    """What a checkpoint saves and restores: together they continue a run exactly."""

    model: nn.Module
    optimizer: AdamWOnPieces  # includes the ZeRO-1 shard of this rank
    lr_schedule: LRSchedule
    data: Any  # SyntheticData or TrainData: micro_batches(step), state_dict(), load_state_dict()
    step: int = 0  # optimizer steps done
    consumed_samples: int = 0
    consumed_tokens: int = 0
    data_step_offset: int = 0  # steps whose data a rollback skipped (data step = step + this)
    extra: dict[str, Any] = field(default_factory=dict)

    def rng_state(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


class Trainer:
    """Holds the parallel context, the TrainState and the per-step machinery."""

    def __init__(self, cfg: Config, pc: ParallelContext, stream: TextIO = sys.stdout) -> None:
        self.cfg, self.pc = cfg, pc
        level = configure_logging(cfg.logging, pc.rank)  # log_level / log_level_replica
        torch.manual_seed(cfg.general.seed)
        random.seed(cfg.general.seed)
        model = build_train_model(cfg, pc)  # perf.py: v chunks, recompute, async tp, compile
        init_path = cfg.model.init_method.path
        if init_path and not cfg.checkpoints.resume_checkpoint_path:  # ExistingCheckpointInit
            mc = padded_model_config(cfg)
            load_initial_weights(model, init_path, mc, pc.tp_rank, pc.tp_size)
        named = list(model.named_parameters())
        self.named_params = named
        self.tied = tied_parameters(model, pc)  # collective when pp > 1
        tied_ids = {id(p) for g in self.tied.groups for p in g.params}
        opt = cfg.optimizer
        zero = opt.zero_stage if pc.dp_size > 1 else 0
        self.zero_stage = zero
        dtype = DTYPES[cfg.model.dtype]
        self.grads = DataParallelGrads(
            [p for _, p in named],
            pc.dp_group,
            pc.dp_size,
            pc.dp_rank,
            grad_dtype=torch.float32 if opt.accumulate_grad_in_fp32 else dtype,
            bucket_cap_mb=cfg.model.ddp_bucket_cap_mb,
            pad_to=pc.dp_size if zero else 1,
            reduce_scatter=bool(zero) and pc.backend == "nccl",
            full_reduce=tied_ids,
        )
        names = {id(p): n for n, p in named}
        pieces = build_pieces(
            owned_ranges(self.grads, zero),
            names,
            exclude_from_decay=opt.weight_decay_exclude_named_params,
        )
        optimizer = AdamWOnPieces(
            pieces,
            lr=opt.learning_rate_scheduler.learning_rate,
            weight_decay=opt.weight_decay,
            **optimizer_kwargs(opt.optimizer_factory),
        )
        schedule = build_lr_schedule(opt.learning_rate_scheduler, cfg.tokens.train_steps)
        data = build_data(cfg, pc)
        self.state = TrainState(model, optimizer, schedule, data)
        self.evaluator = build_evaluator(cfg, pc, model, data)  # None without `validation`
        # Hang watchdog, preemption signals, non-finite policy, loss spikes (fault/).
        self.fault = FaultTolerance(cfg, pc, step=lambda: self.state.step + 1)
        self.trainer_id = self.fault.trainer_id
        self.checkpoints = Checkpointing(self)
        try:  # Removes unfinished saves; resumes when checkpoints.resume_checkpoint_path is set.
            self.last_saved = self.checkpoints.on_start()
        except BaseException:
            self.fault.close()  # signal handlers back, watchdog stopped
            raise
        self.counts = default_counts_in_norm(pc.tp_rank, pc.is_first_stage)
        # z-loss: the loss blocks of this rank (last stage) sum it per micro-batch on the device.
        self.z_loss_blocks = (
            [m for m in model.modules() if isinstance(m, Loss)]
            if cfg.model.model_config.z_loss_enabled
            else []
        )
        self.model_config = padded_model_config(cfg)
        self.peak_tflops = device_peak_tflops(pc.device, dtype)
        self.profiler = StepProfiler(cfg.profiler, pc.rank)  # profiling.py; no-op without it
        self.logger: MetricsLogger | None = None
        if pc.rank == 0:  # stdout, metrics file, TensorBoard, wandb, dashboard
            shown = stream if prints_step_lines(level) else None
            self.logger = build_metrics_logger(
                cfg, pc, shown, resumed_step=self.last_saved, run_id=self._resumed_run_id()
            )
            # Checkpoints name the run that wrote them, so the dashboard links a resumed run.
            self.state.extra["run_id"] = self.logger.run_id

    def train_step(self) -> dict[str, Any]:
        s, cfg, pc = self.state, self.cfg, self.pc
        step = s.step + 1
        self.profiler.begin_step()
        t0 = time.perf_counter()
        micro_batches = s.data.micro_batches(step + s.data_step_offset)
        micro_batches = [{k: v.to(pc.device) for k, v in mb.items()} for mb in micro_batches]
        self.grads.zero_grad()
        result = run_pipeline_step(
            cfg.parallelism.pp_engine,
            s.model,
            micro_batches,
            pc,
            on_last_backward=self.grads.arm,
        )
        self.grads.finish()  # gradients are now the dp mean (ZeRO-1 on NCCL: own chunks)
        self.tied.sync_gradients()  # sum each tied copy's gradient over first and last stage
        norm = global_grad_norm(grad_norm_ranges(self.grads, self.zero_stage), None, self.counts)
        loss = self._global_mean_loss(result.loss)
        z_loss = self._global_mean_z_loss(len(micro_batches)) if self.z_loss_blocks else None
        lr = s.lr_schedule(step)
        # Both values are on the host already and equal on every rank: no extra sync.
        action = self.fault.nonfinite.check(loss, norm)
        if action == "stop":
            raise nonfinite_stop(step, loss, norm, self.state.model.named_parameters(), pc)
        if action == "ok":
            if cfg.optimizer.clip_grad is not None:
                clip_grads(self.grads.params, norm, cfg.optimizer.clip_grad)
            s.optimizer.step(lr)
            if self.zero_stage:
                all_gather_params(self.grads)
        if not cfg.general.ignore_sanity_checks:  # opt-in debugging: syncs every step
            check_dp_replicas(self.named_params, pc.dp_group, pc.dp_size, step)
            if not self.tied.copies_equal():
                raise SanityCheckError(f"step {step}: tied parameter copies disagree")
        if pc.device.type == "cuda":
            torch.cuda.synchronize(pc.device)
        seconds = time.perf_counter() - t0
        seq = cfg.sequence_length_at(step + s.data_step_offset)  # data stages may change it
        tokens = self.cfg.global_batch_size * seq
        s.step = step
        s.consumed_samples += cfg.global_batch_size
        s.consumed_tokens += tokens
        measure = StepMeasure(step, s.consumed_tokens, loss, norm, lr, seconds, tokens)
        self.profiler.end_step()
        record = make_record(
            measure,
            pc.world_size,
            training_flops_per_token(self.model_config, seq),
            self.peak_tflops,
            peak_memory_bytes(pc.device),
            cfg.global_batch_size,
        )
        if z_loss is not None:
            record["z_loss"] = z_loss  # lm_loss includes it, as in Nanotron
        return self.fault.annotate(record, action)

    def _global_mean_loss(self, last_stage_loss: float | None) -> float:
        """Mean over the global batch: the last stage's micro-batch mean, averaged over dp."""
        loss = loss_on_all_pp_ranks(last_stage_loss, self.pc)
        if self.pc.dp_size == 1:
            return loss
        t = torch.tensor([loss], dtype=torch.float64, device=self.pc.device)
        dist.all_reduce(t, group=self.pc.dp_group)
        return float(t.item()) / self.pc.dp_size

    def _global_mean_z_loss(self, micro_batches: int) -> float:
        """The step's mean z-loss (part of lm_loss), on every rank; resets the loss blocks."""
        sums = [m.z_loss_sum for m in self.z_loss_blocks if m.z_loss_sum is not None]
        for m in self.z_loss_blocks:
            m.z_loss_sum = None
        local = float(sum(sums)) / micro_batches if sums else None
        return self._global_mean_loss(local)

    def train(self) -> list[dict[str, Any]]:
        """Run until tokens.train_steps; return every step's record (on every rank)."""
        records = []
        interval = self.cfg.logging.iteration_step_info_interval
        try:
            self._saved(self.checkpoints.save_initial())  # checkpoints.save_initial_state
            while self.state.step < self.cfg.tokens.train_steps:
                rec = self.train_step()
                records.append(rec)
                # not a step about to be rolled back; collective: every rank evaluates
                due = self.evaluator and self.evaluator.due(
                    rec["step"], self.cfg.tokens.train_steps
                )
                if due and rec.get("nonfinite") != "rollback":
                    rec.update(self.evaluator.evaluate().metrics())
                if self.logger is not None and (rec["step"] % interval == 0 or "val_loss" in rec):
                    self.logger.log(rec)
                if rec.get("nonfinite") == "rollback":
                    self.fault.rolled_back(self.state.step, self.checkpoints.rollback(), self.pc)
                    continue
                stop = self.fault.preemption.stop_now(self.state.step)
                self._saved(self.checkpoints.after_step(force=stop))
                if stop:
                    self._saved(self.checkpoints.wait())
                    if self.logger is not None:
                        self.logger.end_status = "preempted"
                    break
            self._saved(self.checkpoints.wait())
        except BaseException as exc:  # the dashboard shows the run as failed, with the error
            if self.logger is not None:
                self.logger.fail(exc)
            raise
        finally:
            self.close()
        csv_path = self.cfg.general.benchmark_csv_path
        if csv_path and self.pc.rank == 0 and records:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.pc.world_size))
            append_row(csv_path, benchmark_row(self.cfg, records, self.pc.world_size, local))
        return records

    def _saved(self, folders) -> None:
        for folder in folders:
            self.last_saved = int(folder.name)
            if self.logger is not None:
                self.logger.checkpoint(folder)

    def _resumed_run_id(self) -> str | None:
        """`--resume auto` continues the run it resumes (a restarted attempt, not a new run)."""
        ck = self.cfg.checkpoints
        if ck.resume_checkpoint_path != "auto" or self.last_saved is None:
            return None
        return checkpoint_run_id(ck.checkpoints_path)

    def close(self) -> None:
        self.fault.close()
        self.profiler.close()
        if hasattr(self.state.data, "close"):  # the prefetch thread (num_loading_workers)
            self.state.data.close()
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        self.grads.remove_hooks()


def train(
    cfg: Config, pc: ParallelContext | None = None, stream: TextIO = sys.stdout
) -> list[dict]:
    """Train `cfg` to the end and return the per-step metric records.

    With `pc=None` a ParallelContext is made from the config (and destroyed at the end);
    tests pass a fresh one per layout to run several layouts in one launch.
    """
    own = pc is None
    if pc is None:
        par = cfg.parallelism
        # The backend's own timeout backs up the watchdog's (fault/watchdog.py), which fires
        # first and says who did not arrive.
        backstop = timedelta(seconds=par.collective_timeout_s + BACKEND_TIMEOUT_MARGIN_S)
        pc = ParallelContext(dp=par.dp, tp=par.tp, pp=par.pp, timeout=backstop)
    try:
        return Trainer(cfg, pc, stream).train()
    finally:
        if own:
            pc.destroy()
