"""The logging rank's metrics sinks: stdout, the JSON lines file, TensorBoard, wandb, and the
dashboard (`dashboard_sink.py`), which also gets run_start, checkpoints and run_end.

The record itself is made in `record.py` and its stdout line in `step_line.py`. In the JSON
lines file each record also names its run and attempt (`run_id`, `attempt`: the ids the
dashboard gets in run_start), so the lines a resumed run appends to the same file (its steps
again after a rollback to a checkpoint) tell the attempts apart.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from nanotron_train.reporting.dashboard_sink import (
    checkpoint_message,
    client_from_config,
    launch_command,
    new_run_id,
    resumed_from,
)
from nanotron_train.reporting.layer_message import (
    layer_scalars,
    layer_stats_message,
    layer_stats_of,
)
from nanotron_train.reporting.step_line import format_line


class MetricsSinkError(ValueError):
    """An optional metrics sink is configured but cannot be used."""


# logging key -> (module, extra of nanotron-train that installs it, hint)
_SINK_PACKAGES = {
    "tensorboard_dir": ("tensorboard", "tensorboard", ""),
    "wandb_project": ("wandb", "wandb", "; WANDB_MODE=offline works without network"),
}


def _missing(key: str) -> str:
    module, extra, hint = _SINK_PACKAGES[key]
    return (
        f"logging.{key} is set but the '{module}' package is not installed "
        f"(pip install 'nanotron-train[{extra}]'{hint})"
    )


def check_optional_sinks(logging_args: Any) -> None:
    """MetricsSinkError for a configured sink whose package is missing; run it on every rank
    before training starts, so the error is one line instead of a failure on rank 0 alone."""
    for key, (module, _, _) in _SINK_PACKAGES.items():
        if not getattr(logging_args, key, None):
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: sys.modules holds None for it
            found = False
        if not found:
            raise MetricsSinkError(_missing(key))


@dataclass
class RunInfo:
    """What the dashboard records about one launch."""

    project: str
    name: str
    config: dict[str, Any]
    world_size: int
    topology: dict[str, int]
    checkpoints_path: str | None = None
    resumed_from: dict[str, Any] | None = None
    command: list[str] = field(default_factory=launch_command)
    cwd: str = field(default_factory=os.getcwd)


class MetricsLogger:
    """The logging rank's sinks: stdout line, JSON lines file, TensorBoard, wandb, dashboard.

    The dashboard sink is on when `dashboard_url` or NANOTRON_DASHBOARD_URL is set and a
    `run` is given; it never blocks or fails training (see dashboard_client.py).
    """

    def __init__(
        self,
        metrics_file: str | None,
        tensorboard_dir: str | None = None,
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
        run_name: str | None = None,
        config: dict | None = None,
        stream: TextIO | None = sys.stdout,
        train_steps: int = 0,
        dashboard_url: str | None = None,
        run: RunInfo | None = None,
        run_id: str | None = None,
    ) -> None:
        self.stream, self.train_steps = stream, train_steps
        self._file: TextIO | None = None
        self._tb = self._wandb = None
        self._dashboard = None
        self._failure: str | None = None
        self.end_status = "finished"  # or "preempted" (set by the trainer)
        # A restarted attempt (--resume auto) keeps the run id of the run it continues.
        self.run_id = run_id or new_run_id(run.project if run else "nanotron", run_name)
        self.attempt = secrets.token_hex(8)  # this launch: the file's records carry both
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise MetricsSinkError(_missing("tensorboard_dir")) from None
            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise MetricsSinkError(_missing("wandb_project")) from None
            self._wandb = wandb.init(
                project=wandb_project, entity=wandb_entity, name=run_name, config=config
            )
        start_offset = 0
        if metrics_file:
            path = Path(metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a")
            start_offset = self._file.tell()  # the dashboard replays only what follows
        if run is not None:
            self._dashboard = client_from_config(
                dashboard_url,
                run_id=self.run_id,
                metrics_file=metrics_file,
                start_offset=start_offset,
            )
        if self._dashboard is not None and run is not None:
            self._dashboard.run_start(
                project=run.project,
                name=run.name,
                config=run.config,
                world_size=run.world_size,
                topology=run.topology,
                command=run.command,
                cwd=run.cwd,
                checkpoints_path=run.checkpoints_path,
                resumed_from=run.resumed_from,
                attempt=self.attempt,
            )

    def log(self, rec: dict[str, Any]) -> None:
        if self.stream is not None:  # None: logging.log_level is above info
            print(format_line(rec, self.train_steps), file=self.stream, flush=True)
        layers = layer_stats_of(rec)  # a detail step's per-layer statistics (metrics_logging)
        self._write(rec, layer_scalars(layers) if layers else {})
        if self._dashboard is not None and layers:  # bounded like telemetry: a heatmap gap
            self._dashboard.telemetry(layer_stats_message(rec["step"], time.time(), layers))

    def log_scores(self, rec: dict[str, Any], line: str) -> None:
        """An evaluation's record (step, consumed_tokens, eval/<task>/<metric>: eval/), with
        its own stdout `line`: to every sink as a step's record goes."""
        if self.stream is not None:
            print(line, file=self.stream, flush=True)
        self._write(rec, {})

    def _write(self, rec: dict[str, Any], extra: dict[str, float]) -> None:
        """`rec` to the metrics file, and its scalars (+ `extra`) to TensorBoard, W&B and the
        dashboard."""
        if self._file is not None:
            self._file.write(json.dumps({**rec, "run_id": self.run_id, "attempt": self.attempt}))
            self._file.write("\n")
            self._file.flush()
        scalars = {k: v for k, v in rec.items() if isinstance(v, int | float) and k != "step"}
        scalars |= extra
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, rec["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=rec["step"])
        if self._dashboard is not None:
            self._dashboard.metrics(rec["step"], rec)  # moe_load too: the load heatmap

    def checkpoint(self, info: dict[str, Any] | str | os.PathLike) -> None:
        """Call after each save with the checkpoint folder (or a ready message dict)."""
        if self._dashboard is not None:
            self._dashboard.checkpoint(checkpoint_message(info))

    def event(self, kind: str, severity: str, message: str, step: int | None, details=None):
        """An event for the dashboard (telemetry/events.py prints its log line)."""
        if self._dashboard is not None:
            self._dashboard.event(kind, severity, message, step, details)

    def telemetry(self, msg: dict[str, Any]) -> None:
        """A rank_stats or pipeline_timeline message for the dashboard."""
        if self._dashboard is not None:
            self._dashboard.telemetry(msg)

    @property
    def streams_to_dashboard(self) -> bool:
        return self._dashboard is not None

    def prediction(self, msg: dict[str, Any]) -> None:
        """The layout planner's prediction of the run (telemetry/prediction.py)."""
        if self._dashboard is not None:
            self._dashboard.prediction(msg)

    def samples(self, msg: dict[str, Any]) -> None:
        if self._dashboard is not None:
            self._dashboard.samples(msg)

    def flush_dashboard(self, timeout: float) -> None:
        """Send what is queued now (a process about to exit without `close`: a hang)."""
        if self._dashboard is not None:
            self._dashboard.close(timeout)

    def fail(self, exc: BaseException) -> None:
        """Mark the run failed: close() then reports run_end("failed", error)."""
        # the traceback's tail: the dashboard shows it on the run page
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._failure = text[-20_000:].strip() or type(exc).__name__

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            import wandb

            self._wandb.finish(exit_code=1 if self._failure else 0)
            wandb.teardown()  # waits for wandb's service to write everything (offline too)
            self._wandb = None
        if self._dashboard is not None:
            if self._failure is None:
                self._dashboard.run_end(self.end_status)
            else:
                self._dashboard.run_end("failed", self._failure)
            self._dashboard.close()  # sends what is queued, a few seconds at most
            self._dashboard = None


def build_metrics_logger(
    cfg,
    pc,
    stream: TextIO | None = sys.stdout,
    resumed_step: int | None = None,
    run_id: str | None = None,
):
    """The logging rank's MetricsLogger for a Trainer (`cfg`: Config, `pc`: ParallelContext)."""
    lg, ck = cfg.logging, cfg.checkpoints
    run = RunInfo(
        project=cfg.general.project,
        name=cfg.general.run or "",
        config=cfg.to_dict(),
        world_size=pc.world_size,
        topology={
            "dp": pc.dp_size,
            "tp": pc.tp_size,
            "pp": pc.pp_size,
            **({"cp": pc.cp_size} if pc.cp_size > 1 else {}),  # context parallel, when used
        },
        checkpoints_path=ck.checkpoints_path,
        # An attempt that continues its own run (same id) is not "resumed from" another run.
        resumed_from=None
        if run_id
        else resumed_from(ck.resume_checkpoint_path, ck.checkpoints_path, resumed_step),
    )
    return MetricsLogger(
        lg.metrics_file,
        lg.tensorboard_dir,
        lg.wandb_project,
        wandb_entity=cfg.general.entity,
        run_name=cfg.general.run,
        config=run.config,
        stream=stream,
        train_steps=cfg.tokens.train_steps,
        dashboard_url=lg.dashboard_url,
        run=run,
        run_id=run_id,
    )
