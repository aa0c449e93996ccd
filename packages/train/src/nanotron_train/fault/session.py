"""The fault-tolerance pieces one Trainer uses, built and torn down together."""

from __future__ import annotations

import sys
from typing import Any

from nanotron_train.fault.coordination import next_trainer_id, shared_store
from nanotron_train.fault.nonfinite import NonFiniteGuard
from nanotron_train.fault.preemption import Preemption
from nanotron_train.fault.spike_recovery import SpikeRecovery
from nanotron_train.fault.spikes import GRAD_NORM_MIN_RATIO, LossSpikeDetector
from nanotron_train.fault.watchdog import HangWatchdog


class FaultTolerance:
    def __init__(self, cfg, pc, step) -> None:
        """`step()` gives the step in progress (for messages)."""
        ft = cfg.fault_tolerance
        self.rank = pc.rank
        self.trainer_id = next_trainer_id()
        multi = pc.world_size > 1
        self.preemption = Preemption(
            pc.rank, shared_store(f"stop{self.trainer_id}") if multi else None
        )
        self.nonfinite = NonFiniteGuard(ft.nonfinite_policy)
        self.spikes = LossSpikeDetector(ft.loss_spike_window, ft.loss_spike_zscore)
        self.spike_recovery = SpikeRecovery(ft, cfg.checkpoints.checkpoints_path, pc)
        self.grad_spikes = LossSpikeDetector(
            ft.grad_norm_spike_window, ft.grad_norm_spike_zscore, GRAD_NORM_MIN_RATIO
        )
        self.watchdog = HangWatchdog(
            pc.rank,
            pc.world_size,
            cfg.parallelism.collective_timeout_s,
            step,
            ft.stack_dump_dir,
            store=shared_store(f"hang{self.trainer_id}") if multi else None,
        ).start()

    def close(self) -> None:
        self.watchdog.stop()
        self.preemption.restore()

    def annotate(self, record: dict[str, Any], action: str) -> dict[str, Any]:
        """Add the non-finite outcome and loss / grad-norm spike z-scores to the step's record
        (numbers reach the dashboard as metrics, telemetry/events.py makes events of them),
        and say so on stderr once (rank 0)."""
        step, loss = record["step"], record["lm_loss"]
        if action != "ok":
            record["nonfinite"] = action
            if action == "skip":
                record["skipped_steps"] = self.nonfinite.skipped
            self._say(
                f"warning: step {step}: non-finite lm_loss={loss} grad_norm={record['grad_norm']}"
                + (
                    f": optimizer step skipped ({self.nonfinite.skipped} so far)"
                    if action == "skip"
                    else ": rolling back"
                )
            )
        elif self.nonfinite.skipped:
            record["skipped_steps"] = self.nonfinite.skipped
        z = self.spikes.observe(loss)
        if z is not None:
            record["loss_spike_z"] = z
            self._say(f"warning: step {step}: loss spike: lm_loss={loss:.6g} (robust z={z:.1f})")
        norm = record["grad_norm"]
        z = self.grad_spikes.observe(norm) if norm is not None and action == "ok" else None
        if z is not None:
            record["grad_norm_spike_z"] = z
            self._say(
                f"warning: step {step}: grad-norm spike: grad_norm={norm:.6g} (robust z={z:.1f})"
            )
        return record

    def rolled_back(self, bad_step: int, to_step: int, pc) -> None:
        self._say(
            f"warning: non-finite values at step {bad_step}: rolled back to the checkpoint of "
            f"step {to_step}; the data of steps {to_step + 1}..{bad_step} is skipped"
        )

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(line, file=sys.stderr, flush=True)
