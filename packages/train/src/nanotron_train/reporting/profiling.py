"""Nanotron's `profiler` section: torch.profiler over the chosen training steps.

The schedule skips `skip_first` + `wait` steps, traces `warmup` steps it throws away, records
`active` steps, `repeat` times (0 = until the end). Each rank writes its trace into
`profiler_export_path` with TensorBoard's handler (`rank{R}.*.pt.trace.json`, open with the
TensorBoard profiler plugin or drop it into https://ui.perfetto.dev), plus a plain chrome
trace `rank{R}_step{N}.chrome_trace.json` when `export_chrome_trace` is set. The ranges the
parallel code records show up by name: `train.step`, `pp.forward stage=S mb=I`,
`pp.backward ...`, `pp.p2p`, `tp.all_reduce` / `tp.all_gather` / `tp.reduce_scatter` (and their
`.async` variants), `dp.reduce_launch` / `dp.reduce_wait`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from torch.profiler import (
    ProfilerActivity,
    profile,
    record_function,
    schedule,
    tensorboard_trace_handler,
)

from nanotron_train.config.schema import ProfilerArgs


class StepProfiler:
    """Started on the first step, advanced once per step, closed at the end of training.
    Does nothing when the config has no profiler section."""

    def __init__(self, args: ProfilerArgs | None, rank: int) -> None:
        self.args, self.rank = args, rank
        self._prof: profile | None = None
        self._range: record_function | None = None

    @property
    def enabled(self) -> bool:
        """Whether this run profiles (the pipeline then also measures saved activations)."""
        return self.args is not None

    def _start(self) -> None:
        a = self.args
        assert a is not None
        out = Path(a.profiler_export_path)
        out.mkdir(parents=True, exist_ok=True)
        tb_handler = tensorboard_trace_handler(str(out), worker_name=f"rank{self.rank}")

        def on_trace_ready(prof: profile) -> None:
            if not a.export_chrome_trace:
                tb_handler(prof)
                return
            # A trace can be saved once: write the chrome trace, copy it under TensorBoard's name.
            chrome = out / f"rank{self.rank}_step{prof.step_num}.chrome_trace.json"
            prof.export_chrome_trace(str(chrome))
            shutil.copyfile(chrome, out / f"rank{self.rank}.{time.time_ns()}.pt.trace.json")

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(
                skip_first=a.skip_first,
                wait=a.wait,
                warmup=a.warmup,
                active=a.active,
                repeat=a.repeat,
            ),
            on_trace_ready=on_trace_ready,
            record_shapes=a.record_shapes,
            profile_memory=a.profile_memory,
            with_stack=a.with_stack,
        )
        self._prof.start()

    def begin_step(self) -> None:
        """Call before each step's work."""
        if self.args is not None and self._prof is None:
            self._start()
        if self._prof is not None:
            self._range = record_function("train.step")
            self._range.__enter__()

    def end_step(self) -> None:
        """Call after each step's work: advances the profiler's schedule."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
