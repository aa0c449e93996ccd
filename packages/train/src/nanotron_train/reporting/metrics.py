"""Per-step metrics: derive throughput/TFLOP/s/MFU, print a Nanotron-style line, write sinks.

The record (one JSON object per logged step, floats at full precision) has: step,
consumed_tokens, lm_loss, grad_norm, lr, tokens_per_sec, tokens_per_sec_per_gpu,
time_per_iteration_ms, model_tflops_per_gpu, mfu (null unless the device's peak is known),
memory (peak bytes: CUDA allocated, or the process's max RSS on CPU), global_batch_size; and
val_loss, val_ppl on the steps that evaluate (every tokens.val_check_interval and the last).
In the JSON lines file each record also names its run and attempt (`run_id`, `attempt`: the
ids the dashboard gets in run_start), so the lines a resumed run appends to the same file
(its steps again after a rollback to a checkpoint) tell the attempts apart.

Sinks of the logging rank: stdout, the JSON lines file, TensorBoard, wandb, and the dashboard
(`dashboard_sink.py`), which also gets run_start, checkpoints and run_end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import secrets
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from nanotron_train.reporting.dashboard_sink import (
    checkpoint_message,
    dashboard_client,
    launch_command,
    new_run_id,
    resumed_from,
)
from nanotron_train.reporting.sizes import format_bytes


class MetricsSinkError(ValueError):
    """An optional metrics sink is configured but cannot be used."""


# Dense bf16/fp16 tensor-core peaks (TFLOP/s) by device-name fragment. Unknown devices and
# other dtypes give None (no MFU) rather than a guess; NANOTRON_PEAK_TFLOPS overrides.
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def device_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    env = os.environ.get("NANOTRON_PEAK_TFLOPS")
    if env:
        return float(env)
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peak in _PEAK_BF16_TFLOPS.items():
        if fragment in name:
            return peak
    return None


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class StepMeasure:
    step: int
    consumed_tokens: int
    lm_loss: float
    grad_norm: float | None
    lr: float
    seconds: float
    tokens_in_step: int


def make_record(
    m: StepMeasure,
    world_size: int,
    flops_per_token: float,
    peak_tflops: float | None,
    memory: int,
    global_batch_size: int,
) -> dict[str, Any]:
    tokens_per_sec = m.tokens_in_step / m.seconds if m.seconds > 0 else float("nan")
    per_gpu = tokens_per_sec / world_size
    tflops = per_gpu * flops_per_token / 1e12
    return {
        "step": m.step,
        "consumed_tokens": m.consumed_tokens,
        "lm_loss": m.lm_loss,
        "grad_norm": m.grad_norm,
        "lr": m.lr,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_gpu": per_gpu,
        "time_per_iteration_ms": m.seconds * 1000.0,
        "model_tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "memory": memory,
        "global_batch_size": global_batch_size,
    }


def _human(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_line(rec: dict[str, Any], train_steps: int) -> str:
    parts = [
        f"iteration: {rec['step']} / {train_steps}",
        f"consumed_tokens: {_human(rec['consumed_tokens'])}",
        f"elapsed_time_per_iteration_ms: {_human(rec['time_per_iteration_ms'])}",
        f"tokens_per_sec: {_human(rec['tokens_per_sec'])}",
        f"tokens_per_sec_per_gpu: {_human(rec['tokens_per_sec_per_gpu'])}",
        f"global_batch_size: {rec['global_batch_size']}",
        f"lm_loss: {rec['lm_loss']:.4g}",
        f"lr: {rec['lr']:.4g}",
        f"model_tflops_per_gpu: {rec['model_tflops_per_gpu']:.3g}",
    ]
    if "z_loss" in rec:
        parts.insert(7, f"z_loss: {rec['z_loss']:.4g}")
    if rec["grad_norm"] is not None:
        parts.append(f"grad_norm: {rec['grad_norm']:.4g}")
    if "val_loss" in rec:  # an evaluation step (evaluation.py)
        parts.append(f"val_loss: {rec['val_loss']:.4g}")
        parts.append(f"val_ppl: {rec['val_ppl']:.4g}")
    if rec["mfu"] is not None:
        parts.append(f"mfu: {100 * rec['mfu']:.2f}%")
    parts.append(f"memory: {format_bytes(rec['memory'])}")
    return " | ".join(parts)


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
            self._dashboard = dashboard_client(
                dashboard_url, self.run_id, metrics_file, start_offset
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
        if self._file is not None:
            self._file.write(json.dumps({**rec, "run_id": self.run_id, "attempt": self.attempt}))
            self._file.write("\n")
            self._file.flush()
        scalars = {k: v for k, v in rec.items() if isinstance(v, int | float) and k != "step"}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, rec["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=rec["step"])
        if self._dashboard is not None:
            self._dashboard.metrics(rec["step"], rec)

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
