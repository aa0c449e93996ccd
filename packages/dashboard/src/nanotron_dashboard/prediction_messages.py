"""The `prediction` message: what the trainer's layout planner predicts for the run's own layout.

Sent once at start by the logging rank (nanotron_train/telemetry/prediction.py), after
run_start; a restarted attempt sends its own, which replaces it. The run page shows it next to
what the run's rank_stats measure (prediction_store.py). Bounded like every ingest message:
a few numbers and two short texts.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .fields import Finite, Int64, Msg, Text

# durations in ms and rates: finite and >= 0
NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Prediction(Msg):
    type: Literal["prediction"]
    step: Int64 = 0  # the step it was made before (0: the start)
    time: Finite | None = None
    device: Text = ""  # the planner's device row, e.g. h100
    device_source: Text = ""  # where its constants come from (vendor sheet, fitted, ...)
    memory_bytes: Int64  # peak of the worst rank
    step_ms: NonNeg
    compute_ms: NonNeg
    comm_ms: NonNeg  # exposed communication
    idle_ms: NonNeg  # pipeline idle
    optimizer_ms: NonNeg
    tokens_per_s_per_device: NonNeg | None = None
    mfu: NonNeg | None = None
