"""The training loop, top to bottom.

config -> ParallelContext -> this rank's blocks (model_factory) -> `parallelize` (tp mode,
recompute, compile, pipeline chunks, data parallel / ZeRO) -> optimizer and LR schedule ->
data -> for each step: pipeline step over the micro-batches (the dp reduction starts during the
last backward), wait for it, tied-gradient sum, clip by the global norm, optimizer step (ZeRO-1:
all-gather the parameters), metrics.

The step never waits for the device: the loss and the gradient norm stay device tensors and
clipping is computed on the device. Only a logged step (every iteration_step_info_interval)
reads them on the host, and its time per iteration is the mean over the steps since the last
logged one. Everything a checkpoint needs lives in one `TrainState` (checkpoints/hooks.py
saves and restores it). The loop over the steps and what follows each step (records, logging,
evaluation, checkpoints) are trainer_loop.py's `TrainingLoop`, which `Trainer` inherits.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist

from nanotron_models.blocks import Loss
from nanotron_models.moe import begin_moe_step, moe_blocks, update_expert_biases
from nanotron_parallel.clip import clip_grads, default_counts_in_norm, global_grad_norm
from nanotron_parallel.context import ParallelContext
from nanotron_parallel.context_parallel import split_batch
from nanotron_parallel.pipeline import run_pipeline_step
from nanotron_parallel.sharding import is_expert_param
from nanotron_train.checkpoints.hooks import Checkpointing
from nanotron_train.config.memory_estimate import check_memory
from nanotron_train.config.schema import Config
from nanotron_train.data.source import build_data
from nanotron_train.data.token_weighting import weigh_by_labelled_tokens
from nanotron_train.eval.during_training import build_checkpoint_evaluator
from nanotron_train.eval.evaluation import build_evaluator
from nanotron_train.fault.sanity import SanityCheckError, check_dp_replicas
from nanotron_train.fault.session import FaultTolerance
from nanotron_train.host_memory import keep_freed_host_memory
from nanotron_train.interop.initial_weights import load_initial_weights
from nanotron_train.lr_schedule import build_lr_schedule
from nanotron_train.model_factory import build_stage_chunks, padded_model_config
from nanotron_train.optimizer import build_optimizer
from nanotron_train.parallelize import parallelize
from nanotron_train.reporting.dashboard_sink import checkpoint_run_id
from nanotron_train.reporting.layer_stats import build_layer_stats
from nanotron_train.reporting.log_levels import configure_logging, prints_step_lines
from nanotron_train.reporting.metrics import MetricsLogger, build_metrics_logger
from nanotron_train.reporting.moe_metrics import build_moe_metrics
from nanotron_train.reporting.profiling import StepProfiler
from nanotron_train.step_record import StepRecorder
from nanotron_train.telemetry.samples import SampleMaker
from nanotron_train.telemetry.session import Telemetry
from nanotron_train.train_state import StepOutput, TrainState
from nanotron_train.trainer_loop import TrainingLoop

BACKEND_TIMEOUT_MARGIN_S = 30.0


class Trainer(TrainingLoop):
    """Holds the parallel context, the TrainState and the per-step machinery; the loop over
    the steps (`train`) and what follows each step are TrainingLoop's (trainer_loop.py)."""

    def __init__(self, cfg: Config, pc: ParallelContext, stream: TextIO | None = None) -> None:
        self.cfg, self.pc = cfg, pc
        stream = sys.stdout if stream is None else stream  # today's, not the one at import
        keep_freed_host_memory()  # host_memory.py: no page faults on every step's allocations
        level = configure_logging(cfg.logging, pc.rank)  # log_level / log_level_replica
        check_memory(cfg, pc)  # memory_estimate.py: refuse what cannot fit, before allocating
        torch.manual_seed(cfg.general.seed)
        random.seed(cfg.general.seed)
        # model_factory builds this rank's blocks; parallelize.py applies, in a documented
        # order, tp mode, recompute, compile, pipeline chunks and data parallel / ZeRO.
        par_model = parallelize(build_stage_chunks(cfg, pc), cfg, pc)
        model, self.tied, self.grads = par_model.model, par_model.tied, par_model.grads
        self._load_initial_weights(model)  # before the optimizer copies any master weight
        self.zero_stage = par_model.zero_stage
        self.named_params = list(model.named_parameters())
        optimizer = self._build_optimizer()
        schedule = build_lr_schedule(cfg.optimizer.learning_rate_scheduler, cfg.tokens.train_steps)
        data = build_data(cfg, pc)
        self.state = TrainState(model, optimizer, schedule, data)
        self.evaluator = build_evaluator(cfg, pc, model, data)  # None without `validation`
        self.downstream = build_checkpoint_evaluator(cfg, pc)  # harness tasks on checkpoints
        # Hang watchdog, preemption signals, non-finite policy, loss spikes (fault/).
        self.fault = FaultTolerance(cfg, pc, step=lambda: self.state.step + 1)
        self.trainer_id = self.fault.trainer_id
        self.checkpoints = Checkpointing(self)
        try:  # Removes unfinished saves; resumes when checkpoints.resume_checkpoint_path is set.
            self.last_saved = self.checkpoints.on_start()
        except BaseException:
            self.fault.close()  # signal handlers back, watchdog stopped
            raise
        self._find_step_tensors(model)
        self.moe = build_moe_metrics(cfg, pc, model)  # None without moe_config
        # per-layer statistics (metrics_logging.log_level 1), None without
        self.layer_stats = build_layer_stats(cfg, pc, model, self.grads, self.named_params)
        self.records = StepRecorder(
            cfg.model,
            cfg.global_batch_size,
            pc,
            self.fault,
            self.named_params,
            self.grads,
            moe=self.moe,
            layers=self.layer_stats,
        )
        self.profiler = StepProfiler(cfg.profiler, pc.rank)  # profiling.py; no-op without it
        # `train()` sets it: run_end goes out after the process groups are torn down.
        self.report_end_later = False
        self.logger = self._open_logger(stream, level)  # rank 0's sinks, else None
        # Per-rank stats, stragglers, pipeline timeline, events (telemetry/); rank 0 sends.
        self.telemetry = Telemetry(cfg, pc, lambda: self.logger, self.fault.watchdog)
        # None without logging.sample_prompts; ZeRO-3 gathers the parameters through grads
        self.samples = SampleMaker.build(cfg, pc, model, self.grads)

    def _load_initial_weights(self, model) -> None:
        """model.init_method.path (ExistingCheckpointInit), unless the run resumes."""
        cfg, pc = self.cfg, self.pc
        init_path = cfg.model.init_method.path
        if init_path and not cfg.checkpoints.resume_checkpoint_path:
            mc = padded_model_config(cfg.model)
            with self.grads.full_parameters():  # ZeRO-3: written back to the shards
                load_initial_weights(model, init_path, mc, pc.tp_rank, pc.tp_size)

    def _build_optimizer(self):
        """The factory's optimizer (AdamW, SGD or Muon with AdamW) over the pieces of the
        parameters this rank owns (all of them without ZeRO)."""
        return build_optimizer(self.cfg.optimizer, self.grads, self.named_params, self.pc.tp_group)

    def _find_step_tensors(self, model) -> None:
        """What every step reads, found once: the flat gradient views the norm reads and
        clipping scales; with z-loss, the loss blocks of this rank (last stage), which sum it
        per micro-batch on the device."""
        counts = default_counts_in_norm(self.pc.tp_rank, self.pc.is_first_stage)
        self.norm_views = self.grads.grad_norm_views(counts)
        self.clip_views = self.grads.owned_grads()
        self.z_loss_blocks = (
            [m for m in model.modules() if isinstance(m, Loss)]
            if self.cfg.model.model_config.z_loss_enabled
            else []
        )
        self.moe_blocks = moe_blocks(model)
        # The ranks whose tokens differ, over which a sigmoid_bias router's load is summed.
        sp = any(b.sequence_parallel for _, b in self.moe_blocks)
        self.bias_groups = (
            [self.pc.dp_cp_group, self.pc.tp_group if sp else None]
            if any(b.router.kind == "sigmoid_bias" for _, b in self.moe_blocks)
            else None
        )

    def _open_logger(self, stream: TextIO, level: str) -> MetricsLogger | None:
        """Rank 0's sinks (stdout, metrics file, TensorBoard, wandb, dashboard); None elsewhere."""
        if self.pc.rank != 0:
            return None
        shown = stream if prints_step_lines(level) else None
        logger = build_metrics_logger(
            self.cfg, self.pc, shown, resumed_step=self.last_saved, run_id=self._resumed_run_id()
        )
        # Checkpoints name the run that wrote them, so the dashboard links a resumed run.
        self.state.extra["run_id"] = logger.run_id
        return logger

    def train_step(self) -> StepOutput:
        """One optimizer step. Nothing in it waits for the device, except on a step that will be
        logged (it reads the loss and the norm, which the record needs anyway, before the
        optimizer step, so a non-finite step is not applied), on every step under the `skip` and
        `rollback` non-finite policies (they decide before the optimizer step), and with the
        opt-in sanity checks. Under `stop`, a non-finite unlogged step is caught at the next
        logged one."""
        with self.telemetry.measure_step():  # phase timers (telemetry/session.py)
            return self._train_step()

    def _train_step(self) -> StepOutput:
        s, cfg, pc, tm = self.state, self.cfg, self.pc, self.telemetry
        step = s.step + 1
        self.profiler.begin_step()
        with tm.span("data", host=True):
            micro_batches = self._micro_batches(step)
        self.grads.zero_grad()
        # expert loads and balance losses of this step's micro-batches only, weighed as each
        # micro-batch's lm loss
        begin_moe_step(self.moe_blocks, len(micro_batches))
        recorder = tm.timeline_recorder(step)  # the pipeline timeline's step, else a no-op
        detail = self._detail(step)  # per-layer statistics: hooks on this step's blocks only
        if detail:
            self.layer_stats.watch()
        with tm.span("pipeline"):
            result = run_pipeline_step(
                cfg.parallelism.pp_engine,
                s.model,
                micro_batches,
                pc,
                on_last_backward=self.grads.arm,
                track_activations=self.profiler.enabled,
                recorder=recorder,
            )
        if detail:
            self.layer_stats.unwatch()
        with tm.span("dp_wait"):
            self.grads.finish()  # now the dp x cp mean (ZeRO-1 reduce-scatter: own chunks)
            self.tied.sync_gradients(self.grads.tied_grad)  # sum over first & last stage
        with tm.span("optimizer"):
            norm = global_grad_norm(self.norm_views, None, pc.device)
        z_loss = self._take_z_loss(len(micro_batches))
        lr = s.lr_schedule(step)
        action, host_values = "ok", None
        logged = step % cfg.logging.iteration_step_info_interval == 0 or detail
        if detail:  # the weights and gradients before clipping and the step
            self.layer_stats.before_update()
        if logged or self.fault.nonfinite.policy != "stop":
            host_values = (self.records.global_mean_loss(result.loss_tensor), float(norm))
            action = self.records.check_finite(step, *host_values)  # raises under `stop`
        if action == "ok":
            with tm.span("optimizer"):
                if cfg.optimizer.clip_grad is not None:
                    clip_grads(self.clip_views, norm, cfg.optimizer.clip_grad)
                s.optimizer.step(lr)
                self.grads.gather_params()  # ZeRO: every rank gets the others' parameters
                if self.bias_groups is not None:  # sigmoid_bias routers: against the load
                    update_expert_biases(self.moe_blocks, self.bias_groups)
        if detail:
            self.layer_stats.after_update()
        if not cfg.general.ignore_sanity_checks:  # opt-in debugging: syncs every step
            self._check_replicas(step)
        seq = cfg.sequence_length_at(step + s.data_step_offset)  # data stages may change it
        s.step = step
        s.consumed_samples += cfg.global_batch_size
        s.consumed_tokens += cfg.global_batch_size * seq
        self.profiler.end_step()
        return StepOutput(step, result.loss_tensor, norm, lr, seq, z_loss, action, host_values)

    def _micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The step's micro-batches on this rank's device, their labelled tokens counted."""
        s, pc = self.state, self.pc
        micro_batches = s.data.micro_batches(step + s.data_step_offset)
        # SFT: the loss is token-weighted over the global batch (data/token_weighting.py)
        self.records.add_labelled(weigh_by_labelled_tokens(micro_batches, pc))
        return [  # under context parallel, this cp rank's two chunks of each sequence
            {k: v.to(pc.device) for k, v in split_batch(mb, pc.cp_rank, pc.cp_size).items()}
            for mb in micro_batches
        ]

    def _check_replicas(self, step: int) -> None:
        """general.ignore_sanity_checks: false: every dp (and expert dp) replica holds the same
        parameters after the step, and the tied copies agree."""
        pc = self.pc
        with self.grads.full_parameters():
            dense = [(n, p) for n, p in self.named_params if not is_expert_param(p)]
            check_dp_replicas(dense, pc.dp_cp_group, pc.dp_cp_size, step)
            experts = [(n, p) for n, p in self.named_params if is_expert_param(p)]
            check_dp_replicas(experts, pc.edp_cp_group, pc.edp_cp_size, step)  # same ep
            if not self.tied.copies_equal():
                raise SanityCheckError(f"step {step}: tied parameter copies disagree")

    def _detail(self, step: int) -> bool:
        """A step with per-layer statistics (metrics_logging): it is also a logged step."""
        return self.layer_stats is not None and self.layer_stats.due(step)

    def _take_z_loss(self, micro_batches: int) -> torch.Tensor | None:
        """This rank's mean z-loss of the step (on the device), resetting the loss blocks."""
        sums = [m.z_loss_sum for m in self.z_loss_blocks if m.z_loss_sum is not None]
        for m in self.z_loss_blocks:
            m.z_loss_sum = None
        return sum(sums) / micro_batches if sums else None

    def step_record(self, out: StepOutput, seconds_per_step: float) -> dict[str, Any]:
        """The metrics record of a step: reads the loss and the norm on the host (a sync, and
        collective over pp and dp for the loss: every rank calls it for the same steps).
        Under the `stop` policy a non-finite loss or norm stops the run here."""
        return self.records.record(out, seconds_per_step, self.state.consumed_tokens)

    def _resumed_run_id(self) -> str | None:
        """`--resume auto` continues the run it resumes (a restarted attempt, not a new run)."""
        ck = self.cfg.checkpoints
        if ck.resume_checkpoint_path != "auto" or self.last_saved is None:
            return None
        return checkpoint_run_id(ck.checkpoints_path)

    def close(self) -> None:
        """Stop this trainer's threads and hooks; the logger stays open for `report_end`."""
        self.fault.close()
        self.profiler.close()
        if hasattr(self.state.data, "close"):  # the prefetch thread (num_loading_workers)
            self.state.data.close()
        self.grads.remove_hooks()

    def report_end(self) -> None:
        """Close the sinks; the dashboard gets run_end (finished, preempted or failed). Called
        after the teardown, so that a run shown finished has nothing left that can fail."""
        if self.logger is not None:
            self.logger.close()
            self.logger = None


def train(
    cfg: Config,
    pc: ParallelContext | None = None,
    stream: TextIO | None = None,  # None: sys.stdout
    on_record: Callable[[dict[str, Any]], None] | None = None,
    every_step: bool = False,
) -> dict | None:
    """Train `cfg` to the end; return the last logged record (see `Trainer.train`).

    With `pc=None` a ParallelContext is made from the config (and destroyed at the end);
    tests pass a fresh one per layout to run several layouts in one launch.
    """
    own = pc is None
    if pc is None:
        par = cfg.parallelism
        # The backend's own timeout backs up the watchdog's (fault/watchdog.py), which fires
        # first and says who did not arrive.
        backstop = timedelta(seconds=par.collective_timeout_s + BACKEND_TIMEOUT_MARGIN_S)
        pc = ParallelContext(
            dp=par.dp,
            tp=par.tp,
            pp=par.pp,
            timeout=backstop,
            cp=par.context_parallel_size,
            ep=par.expert_parallel_size,
        )
    trainer = None
    try:
        trainer = Trainer(cfg, pc, stream)
        trainer.report_end_later = True
        last = trainer.train(on_record, every_step)
        if own:
            if pc.world_size > 1:
                dist.barrier()  # every rank is done before rank 0 reports the run finished
            pc.destroy()
        return last
    except BaseException as exc:
        if trainer is not None and trainer.logger is not None:
            trainer.logger.fail(exc)  # also a failure after the last step: the teardown
        raise
    finally:
        try:
            if own:
                pc.destroy()  # (again: a no-op once done)
        finally:
            if trainer is not None:
                trainer.report_end()  # run_end only now (process_exit.py: nothing after)
