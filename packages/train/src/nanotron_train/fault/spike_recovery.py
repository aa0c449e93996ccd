"""Loss-spike recovery (`fault_tolerance.loss_spike_policy: rollback`), as PaLM and OLMo do by
hand: on a loss spike at step S, go back to the newest checkpoint c <= S - N
(`spike_rollback_min_steps`), skip data, and train on; at most K (`max_spike_rollbacks`) times
per run, then stop.

The data stream never goes back. The batches of steps c+1..S, whose updates the rollback
undoes, are not replayed (replaying them would retrace the same path into the spike), and the
M (`spike_skip_batches`) batches after the spike's own are skipped too: step c+1 then trains on
the batch that would have followed them. Batches are counted in the data stream (a previous
rollback moves it ahead of the step: data step = step + data_step_offset).

Every rank decides the same: the spike is flagged from the global loss, which every rank
holds; rank 0 picks the checkpoint and tells the others. A restart continues after the skip,
not into the spike again: the rollback goes into the train state (`spike_rollbacks`, the count
towards K and what each skipped), and checkpoint c is saved again with it as the newest. The
checkpoints after c belong to the abandoned trajectory: they move to
`<checkpoints_path>/rolled_back/<n>-spike-<S>/` (kept for a post-mortem; they would otherwise
be resumed from, or refused as newer than the run's checkpoint).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nanotron_train.checkpoints.layout import METADATA_FILE, list_dirs
from nanotron_train.checkpoints.load import load_checkpoint
from nanotron_train.fault.errors import TrainingStopped

ROLLED_BACK_DIR = "rolled_back"


@dataclass
class SpikeRollback:
    """One rollback: the spike's step, the checkpoint's, and the data batches skipped
    (first..last, inclusive, in data-stream numbering)."""

    number: int  # 1 for the run's first
    spike_step: int
    to_step: int
    first_skipped: int
    last_skipped: int

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def message(self) -> str:
        return (
            f"loss spike at step {self.spike_step}: rolled back to the checkpoint of step "
            f"{self.to_step} (spike rollback {self.number}); data batches {self.first_skipped}.."
            f"{self.last_skipped} skipped"
        )


class SpikeRecovery:
    def __init__(self, ft, checkpoints_path: str | None, pc) -> None:
        self.ft, self.pc = ft, pc
        self.root = Path(checkpoints_path) if checkpoints_path else None
        self.enabled = ft.loss_spike_policy == "rollback"
        self.pending: SpikeRollback | None = None
        self._stop: str | None = None
        self._saved: list[Path] = []  # background saves completed while planning

    def plan(self, record: dict[str, Any], trainer) -> None:
        """On every rank, for a record that fault/session.py flagged with `loss_spike_z`: decide
        the rollback (`act` makes it, after the record is logged) and add it to the record
        (`spike_rollback`); or, past K rollbacks, the stop. Collective on a spike."""
        if not self.enabled or "loss_spike_z" not in record:
            return
        step, ft, state = record["step"], self.ft, trainer.state
        done = len(state.spike_rollbacks)
        if done >= ft.max_spike_rollbacks:
            self._stop = (
                f"loss spike at step {step} (lm_loss={record['lm_loss']:.6g}, robust z="
                f"{record['loss_spike_z']:.1f}) after {done} spike rollbacks in this run "
                f"(fault_tolerance.max_spike_rollbacks={ft.max_spike_rollbacks}): stopping"
            )
            return
        at_most = step - ft.spike_rollback_min_steps
        # a background save still being written may be the one: wait for it (collective, as
        # every rank holds the same pending step), so the choice is not the disk's speed
        writer = trainer.checkpoints.writer
        if writer is not None and writer.pending is not None and writer.pending <= at_most:
            self._saved = trainer.checkpoints.wait()
        found = self._agreed_checkpoint(at_most)
        if found is None:
            self._say(
                f"warning: loss spike at step {step}: no checkpoint at or before step "
                f"{at_most} in {self.root} to roll back to "
                f"(fault_tolerance.spike_rollback_min_steps={ft.spike_rollback_min_steps}); "
                "training goes on"
            )
            return
        to_step, offset = found
        served = step + state.data_step_offset  # the spike's data batch
        first = to_step + 1 + offset  # the first batch whose update the rollback undoes
        self.pending = SpikeRollback(done + 1, step, to_step, first, served + ft.spike_skip_batches)
        record["spike_rollback"] = self.pending.to_dict()

    def due(self) -> bool:
        return self.pending is not None or self._stop is not None

    def act(self, trainer) -> list[Path]:
        """After the record is logged: stop, or roll back (collective); returns the checkpoint
        folders whose saves completed (for the logger)."""
        if self._stop is not None:
            raise TrainingStopped(self._stop)
        rb, self.pending = self.pending, None
        assert rb is not None, "act() without a planned rollback"
        t, s = trainer, trainer.state
        saved, self._saved = [*self._saved, *t.checkpoints.wait()], []
        history = [*s.spike_rollbacks, rb.to_dict()]
        position = s.data.state_dict()  # after the spike's batch
        with t.grads.full_parameters():  # ZeRO-3: the loaded values go to the shards
            load_checkpoint(self.root / str(rb.to_step), s, t.cfg, t.pc, t.zero_stage)
        s.data.load_state_dict(position)
        for data_step in range(rb.last_skipped - self.ft.spike_skip_batches + 1,
                               rb.last_skipped + 1):  # fmt: skip
            s.data.micro_batches(data_step)  # drawn and dropped: the position moves past it
        s.data_step_offset = rb.last_skipped - s.step
        s.spike_rollbacks = history
        if self.pc.rank == 0:
            self._set_aside(rb)
        self._say(f"warning: {rb.message()}")
        t.checkpoints.last_saved = None  # save step c again, now with the rollback in it
        return [*saved, *t.checkpoints.after_step(force=True)]

    def _agreed_checkpoint(self, at_most: int) -> tuple[int, int] | None:
        """(step, data_step_offset) of rank 0's newest complete checkpoint at or before
        `at_most`, on every rank."""
        found: list[tuple[int, int] | None] = [None]
        if self.pc.rank == 0:
            old = [d for d in list_dirs(self.root) if (d / METADATA_FILE).is_file()]
            old = [d for d in old if int(d.name) <= at_most]
            if old:
                data = json.loads((old[-1] / "data_state.json").read_text())
                found[0] = (int(old[-1].name), int(data.get("data_step_offset", 0)))
        if self.pc.world_size > 1:
            dist.broadcast_object_list(found, src=0, group=self.pc.world_group)
        return found[0]

    def _set_aside(self, rb: SpikeRollback) -> None:
        """Move the checkpoints after the one rolled back to out of the step folders."""
        newer = [d for d in list_dirs(self.root) if int(d.name) > rb.to_step]
        if not newer:
            return
        aside = self.root / ROLLED_BACK_DIR / f"{rb.number}-spike-{rb.spike_step}"
        aside.mkdir(parents=True, exist_ok=True)
        for folder in newer:
            folder.rename(aside / folder.name)

    def _say(self, line: str) -> None:
        if self.pc.rank == 0:
            print(line, file=sys.stderr, flush=True)
