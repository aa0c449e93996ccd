"""`Trainer.train`, the loop over the steps, and what follows each step: the step's record when
it is due (logged on rank 0, with the validation metrics when evaluation is due, kept for the
benchmark CSV row), telemetry, a rollback, and the checkpoint hook (a save when due, at once
when preempted, then samples and in-process evaluation of what was saved).

`Trainer` (trainer.py) inherits `TrainingLoop`: these methods read what `Trainer.__init__`
builds (state, checkpoints, fault, telemetry, logger, evaluator, ...) and call its
`train_step`, `step_record`, `close` and `report_end`. They stay methods of the trainer:
benchmarks call and time `Trainer._record_if_due` and `Trainer._save_if_due`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from nanotron_train.reporting.benchmark_csv import append_row, benchmark_row
from nanotron_train.reporting.record import StepTimer
from nanotron_train.train_state import StepOutput


class TrainingLoop:
    """`Trainer.train` and what it does after each step (see the module's docstring)."""

    def train(
        self,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        every_step: bool = False,
    ) -> dict | None:
        """Run until tokens.train_steps. Every iteration_step_info_interval steps (and at a
        non-finite step) a record is made on every rank, logged (rank 0) and passed to
        `on_record`; returns the last one. Nothing accumulates over the run (except the records
        of general.benchmark_csv_path, when set, for its summary row). `every_step` (tests,
        tools) makes a record of every step for `on_record`, logging only the usual ones: it
        reads the loss and norm every step."""
        csv_path = self.cfg.general.benchmark_csv_path
        bench_records: list[dict[str, Any]] | None = [] if csv_path else None
        last: dict[str, Any] | None = None
        try:
            self._saved(self.checkpoints.save_initial())  # checkpoints.save_initial_state
            timer = StepTimer(self.pc.device)
            while self.state.step < self.cfg.tokens.train_steps:
                out = self.train_step()
                timer.count()
                record = self._record_if_due(out, timer, every_step, on_record, bench_records)
                last = record if record is not None else last
                self.telemetry.after_step(out.step)  # rank stats, timeline: collective
                if out.action == "rollback":
                    self.fault.rolled_back(self.state.step, self.checkpoints.rollback(), self.pc)
                    continue
                if self.fault.spike_recovery.due():  # loss_spike_policy: rollback
                    self._saved(self.fault.spike_recovery.act(self))
                    continue
                stop, saved = self._save_if_due()
                if stop:
                    break
                if saved:
                    timer.restart()
            self._saved(self.checkpoints.wait())
        except BaseException as exc:  # the dashboard shows the run as failed, with the error
            self.telemetry.on_failure(exc)  # a non-finite stop is also an event
            if self.logger is not None:
                self.logger.fail(exc)
            raise
        finally:
            self.close()
            if not self.report_end_later:
                self.report_end()
        if csv_path and self.pc.rank == 0 and bench_records:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.pc.world_size))
            append_row(csv_path, benchmark_row(self.cfg, bench_records, self.pc.world_size, local))
        return last

    def _record_if_due(self, out: StepOutput, timer: StepTimer, every_step: bool, on_record,
                       bench_records: list | None) -> dict[str, Any] | None:  # fmt: skip
        """The record of a logged step (interval, non-finite, evaluation), or of any step with
        `every_step`: evaluated when due, logged (rank 0), passed to `on_record`, kept for the
        benchmark row. None on a step without a record."""
        # not a step about to be rolled back; collective: every rank evaluates
        due = self.evaluator and self.evaluator.due(out.step, self.cfg.tokens.train_steps)
        evaluate = due and out.action != "rollback"
        interval = self.cfg.logging.iteration_step_info_interval
        logged = out.step % interval == 0 or out.action != "ok" or evaluate
        logged = logged or self._detail(out.step)
        if not (logged or every_step):
            return None
        record = self.step_record(out, timer.seconds_per_step())
        self.fault.spike_recovery.plan(record, self)  # a loss spike: roll back after logging
        if evaluate:
            record.update(self.evaluator.evaluate().metrics())
        if self.logger is not None and logged:  # + events and system/* metrics
            self.logger.log(self.telemetry.on_record(record))
        if on_record is not None:
            on_record(record)
        if bench_records is not None and logged:
            bench_records.append(record)
        timer.restart()  # time steps, not logging
        return record

    def _save_if_due(self) -> tuple[bool, list]:
        """Save when due, at once when preempted (then wait for it and stop); samples when a
        save began. Returns (stop, the saves that finished)."""
        # After the last step a stop changes nothing (the loop ends, the last step is saved),
        # and the rank hosting the store may already have left: no store lookup then.
        final = self.state.step >= self.cfg.tokens.train_steps
        stop = not final and self.fault.preemption.stop_now(self.state.step)
        before = self.checkpoints.last_saved
        saved = self.checkpoints.after_step(force=stop)
        self._saved(saved)
        if self.samples is not None and self.checkpoints.last_saved != before:
            self.samples.make(self.state.step, self.logger)  # a save began: samples
        if stop:
            self._saved(self.checkpoints.wait())
            if self.logger is not None:
                self.telemetry.preempted(self.state.step, self.fault, self.last_saved)
                self.logger.end_status = "preempted"
        return stop, saved

    def _saved(self, folders) -> None:
        for folder in folders:
            self.last_saved = int(folder.name)
            if self.logger is not None:
                self.logger.checkpoint(folder)
            if self.downstream is not None:  # evaluation.mode: in_process; collective
                self.downstream.after_save(folder, self.logger, self.telemetry.events)
