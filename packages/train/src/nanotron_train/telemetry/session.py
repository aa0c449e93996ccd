"""What the trainer holds for telemetry: phase timers, the interval's gather, the timeline, events.

Per step (when `logging.rank_stats_interval` > 0): `measure_step()` wraps the step and makes its
timer the one the tp collectives and pp transfers report to; `span(phase)` times the trainer's
own phases. Nothing here reads the device during a step. After the step, `after_step(step)`
runs the interval's single gather (every rank, the same steps) and, on rank 0, sends
rank_stats, checks for stragglers and sends the recorded pipeline timeline.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from nanotron_parallel.phase_timer import NO_SPAN, PhaseTimer, activate, deactivate
from nanotron_parallel.pipeline import NO_RECORDER, TimelineRecorder, engine
from nanotron_train.fault.errors import NonFiniteStop
from nanotron_train.telemetry import clock, rank_stats, timeline
from nanotron_train.telemetry.events import EventReporter, ThroughputWatch, record_events
from nanotron_train.telemetry.prediction import send_prediction
from nanotron_train.telemetry.stragglers import StragglerDetector, busy_ms
from nanotron_train.telemetry.system import CpuMeter, Nvml, SystemMetrics


class Telemetry:
    def __init__(self, cfg, pc, logger_of, watchdog=None) -> None:
        """`logger_of()`: rank 0's MetricsLogger (None elsewhere); `watchdog`: the hang
        watchdog, which then reports a stall through `on_hang` before the process exits."""
        lg, par = cfg.logging, cfg.parallelism
        self.pc, self.logger_of = pc, logger_of
        self.interval = lg.rank_stats_interval
        self.timer = PhaseTimer(pc.device) if self.interval else None
        self.places = rank_stats.gather_places(pc) if self.interval else []
        self.cpu = CpuMeter()
        self.nvml = Nvml.open(pc.device) if self.interval else None
        self.stragglers = StragglerDetector(lg.straggler_margin, lg.straggler_intervals)
        self.timeline_interval = lg.pipeline_timeline_interval if pc.pp_size > 1 else 0
        self.engine = par.pp_engine
        self.chunks = engine(par.pp_engine).chunks(par.pp_virtual_stages)
        self.micro_batches = cfg.tokens.batch_accumulation_per_replica
        self._recorder: TimelineRecorder | None = None
        self.events = EventReporter(pc.rank, logger_of)
        self.throughput = ThroughputWatch(lg.throughput_drop_fraction)
        self.system = SystemMetrics(pc.device) if pc.rank == 0 else None
        self.last_rank_stats: list[dict] | None = None  # rank 0: the latest table
        self.last_timeline: dict | None = None
        if watchdog is not None:
            watchdog.on_hang = self.on_hang
        send_prediction(cfg, pc, logger_of())  # the planner's, once: the dashboard compares

    # --- during the step ------------------------------------------------------------------
    @contextlib.contextmanager
    def measure_step(self) -> Iterator[None]:
        timer = self.timer
        if timer is None:
            yield
            return
        activate(timer)
        try:
            with timer.span("step"):
                yield
        finally:
            deactivate()
        timer.steps += 1

    def span(self, phase: str, host: bool = False):
        return NO_SPAN if self.timer is None else self.timer.span(phase, host)

    def timeline_recorder(self, step: int):
        """A recorder on the steps the timeline records, NO_RECORDER otherwise. Before it,
        every rank meets in clock.align (a barrier that also measures each rank's clock
        against rank 0's), then notes its origin: the spans are put on one time line."""
        if not self.timeline_interval or step % self.timeline_interval:
            return NO_RECORDER
        self._theta, self._theta_u = clock.align(self.pc.world_group, self.pc.world_size)
        if self.pc.device.type == "cuda":
            torch.cuda.synchronize(self.pc.device)
        self._origin = time.perf_counter()
        self._recorder = TimelineRecorder(self.pc.device)
        return self._recorder

    # --- after the step (collective: every rank, same steps) -------------------------------
    def after_step(self, step: int) -> None:
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            self._send_timeline(step, recorder.spans())
        if self.interval and step % self.interval == 0:
            self._send_rank_stats(step)

    def _send_rank_stats(self, step: int) -> None:
        totals, steps = self.timer.collect()
        extra = {
            "cpu_util_pct": self.cpu.percent(),
            "gpu_util_pct": self.nvml.utilization_pct() if self.nvml else None,
            "gpu_power_w": self.nvml.power_w() if self.nvml else None,
        }
        row = rank_stats.local_row(totals, steps, self.pc.device, extra)
        table = rank_stats.gather_rows(row, self.pc)
        if self.pc.rank != 0:
            return
        ranks = rank_stats.entries(table, self.places)
        self.last_rank_stats = ranks
        logger = self.logger_of()
        if logger is not None:
            for msg in rank_stats.messages(step, time.time(), self.interval, ranks):
                logger.telemetry(msg)
        for entry, ratio in self.stragglers.observe(ranks):
            place = rank_stats.Place(
                **{k: entry[k] for k in ("rank", "host", "dp", "tp", "pp", "cp")}
            )
            median = busy_ms(entry) / ratio
            self.events.emit(
                "straggler",
                "warning",
                f"rank {place.rank} ({place.coordinates()}, host {place.host}) compute "
                f"{ratio:.2f}x the median of the other ranks of its stage ({busy_ms(entry):.1f} ms vs {median:.1f} "
                f"ms of compute+optimizer+data per step) for {self.stragglers.intervals} "
                "intervals",
                step,
                {**place.details(), "ratio": ratio, "busy_ms": busy_ms(entry), "median_ms": median},
            )

    def _send_timeline(self, step: int, spans: list[dict]) -> None:
        spans = clock.to_rank0_clock(spans, self._origin, self._theta)
        stage_clocks = clock.gather_stage_clocks(self.pc, self._origin, self._theta, self._theta_u)
        gathered = timeline.gather_spans(spans, self.pc)
        if gathered is None:
            return
        gathered, aligned = clock.rebase(gathered, stage_clocks, self._origin * 1000.0)
        pp, v, m = self.pc.pp_size, self.chunks, self.micro_batches
        msg = timeline.timeline_message(step, time.time(), self.engine, pp, v, m, gathered)
        msg["clock"].update(aligned)
        self.last_timeline = msg
        bad = msg["clock"]["order_violations"]
        measured = (
            f"no bubble measured ({bad} spans start before their input was sent: the rank "
            "clocks disagree)"
            if bad
            else f"bubble {msg['bubble_measured']:.3f} measured"
        )
        print(
            f"pipeline timeline at step {step}: {measured}, "
            f"{msg['bubble_formula']:.3f} planned by the engine's formula "
            f"({self.engine}, pp={pp}, v={v}, m={m}, {len(gathered)} spans)",
            flush=True,
        )
        logger = self.logger_of()
        if logger is not None:
            logger.telemetry(msg)

    # --- rank 0's record and the run's end -------------------------------------------------
    def on_record(self, record: dict) -> dict:
        """Rank 0's logged record: its events, plus the system/* metrics."""
        record_events(record, self.events, self.throughput)
        if self.system is not None:
            record = {**record, **self.system.values()}
        return record

    def on_failure(self, exc: BaseException) -> None:
        if isinstance(exc, NonFiniteStop):
            self.events.emit("nonfinite_loss", "critical", str(exc), exc.step, say=False)

    def preempted(self, step: int, fault, saved_step: int | None) -> None:
        """`fault`: the FaultTolerance, whose preemption knows the signal (on this rank)."""
        signal_name = fault.preemption.signal_name
        by = f"{signal_name} received" if signal_name else "a rank was signalled"
        saved = (
            f"checkpoint saved at step {step}, the run stops (resume it to continue)"
            if saved_step == step
            else f"the run stops at step {step} without a checkpoint (no checkpoints_path)"
        )
        self.events.emit(
            "preemption",
            "warning",
            f"{by}: {saved}",
            step,
            {"signal": signal_name, "saved_step": saved_step},
        )

    def on_hang(self, line: str, details: dict) -> None:
        """The hang watchdog is about to end the process (its own thread): report, flush."""
        step = details.get("step")
        self.events.emit(
            "stall", "critical", line, step if isinstance(step, int) else None, details, say=False
        )
        logger = self.logger_of()
        if logger is not None:
            logger.flush_dashboard(3.0)
