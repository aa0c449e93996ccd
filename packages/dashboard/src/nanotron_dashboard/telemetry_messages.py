"""Telemetry messages: per-rank times, the pipeline timeline, events and samples.

Each is bounded like the other ingest messages (see fields.py); docs/internals.md and the
contract in README describe what the trainer sends.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from .fields import (
    MAX_DETAILS_BYTES,
    MAX_RANKS,
    MAX_SAMPLES,
    MAX_SPAN_KINDS,
    MAX_SPANS,
    Finite,
    Int64,
    Msg,
    Text,
    bounded_json,
)

# durations and rates: finite and >= 0
NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Coord = Annotated[int, Field(ge=0, le=1 << 24)]  # a rank or a parallel coordinate
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
NoNul = r"^[^\x00]*$"
# A span's kind is whatever the schedule calls its work ("forward", "backward", a zero-bubble
# schedule's "W", ...): any short name, so that a new schedule needs no dashboard release.
SpanKind = Annotated[str, StringConstraints(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")]


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A phase this release does not know (a new communication the trainer times): shown by its name.
# Matched whole (re.fullmatch): `$` would also match before a trailing newline.
PHASE_NAME = r"[a-z][a-z0-9_]{0,47}_ms"
MAX_EXTRA_PHASES = 8  # distinct unknown phases in one message (and in one stored interval)


def is_phase_name(name: str) -> bool:
    return re.fullmatch(PHASE_NAME, name) is not None


def _phase_time(k: str, v: object) -> None:
    """A phase time is a number >= 0 that a float holds (a 400-digit integer is not), or null."""
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{k}: a phase time is a number >= 0 or null")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"{k}: {str(v)[:20]}... is too large for a time in ms") from None
    if not 0 <= f < math.inf:
        raise ValueError(f"{k}: a phase time is a finite number >= 0 or null")


class RankEntry(_Part):
    model_config = ConfigDict(extra="allow")  # unknown phases: checked by _phases
    rank: Coord
    host: Text | None = None
    dp: Coord
    tp: Coord
    pp: Coord
    cp: Coord = 0
    step_ms: NonNeg
    compute_ms: NonNeg | None = None
    tp_comm_ms: NonNeg | None = None
    all_to_all_ms: NonNeg | None = None  # expert parallel's dispatch and combine
    pp_wait_ms: NonNeg | None = None
    dp_wait_ms: NonNeg | None = None
    optimizer_ms: NonNeg | None = None
    data_ms: NonNeg | None = None
    mem_bytes: Int64 | None = None
    mem_reserved_bytes: Int64 | None = None
    gpu_util_pct: NonNeg | None = None
    gpu_power_w: NonNeg | None = None
    cpu_util_pct: NonNeg | None = None

    @model_validator(mode="after")
    def _phases(self) -> RankEntry:
        extra = self.model_extra or {}
        if len(extra) > MAX_EXTRA_PHASES:
            raise ValueError(f"{len(extra)} unknown fields, over the limit of {MAX_EXTRA_PHASES}")
        for k, v in extra.items():
            if not is_phase_name(k):
                raise ValueError(f"unknown field {k[:60]!r}: a phase is named like 'name_ms'")
            _phase_time(k, v)
        return self

    def phases(self) -> dict[str, float | None]:
        """The unknown phases' times, by field name."""
        return {k: None if v is None else float(v) for k, v in (self.model_extra or {}).items()}


# the numeric fields of a RankEntry, in the order the database packs them by default; a row
# stored by an earlier release packs LEGACY_RANK_FIELDS (rank_stats.fields is NULL)
LEGACY_RANK_FIELDS = (
    "step_ms",
    "compute_ms",
    "tp_comm_ms",
    "pp_wait_ms",
    "dp_wait_ms",
    "optimizer_ms",
    "data_ms",
    "mem_bytes",
    "mem_reserved_bytes",
    "gpu_util_pct",
    "gpu_power_w",
    "cpu_util_pct",
)
RANK_FIELDS = (
    "step_ms",
    "compute_ms",
    "tp_comm_ms",
    "all_to_all_ms",
    "pp_wait_ms",
    "dp_wait_ms",
    "optimizer_ms",
    "data_ms",
    "mem_bytes",
    "mem_reserved_bytes",
    "gpu_util_pct",
    "gpu_power_w",
    "cpu_util_pct",
)
# Parsed memory per entry or span (pydantic models, measured with tracemalloc): a rank
# entry can be ~56 bytes of JSON (24x), so the 12x-the-JSON estimate would undercount it.
RANK_ENTRY_MEMORY = 1600
SPAN_MEMORY = 1200


class RankStats(Msg):
    type: Literal["rank_stats"]
    step: Int64
    time: Finite | None = None
    interval: Annotated[int, Field(ge=1, le=1 << 31)] = 1
    ranks: list[RankEntry] = Field(min_length=1, max_length=MAX_RANKS)

    @field_validator("ranks")
    @classmethod
    def _unique(cls, v: list[RankEntry]) -> list[RankEntry]:
        if len({r.rank for r in v}) != len(v):
            raise ValueError("each rank must appear once")
        names = {k for r in v for k in r.phases()}
        if len(names) > MAX_EXTRA_PHASES:
            raise ValueError(f"{len(names)} unknown phases, over the limit of {MAX_EXTRA_PHASES}")
        return v

    def memory_bytes(self) -> int:
        return len(self.ranks) * RANK_ENTRY_MEMORY


class Span(_Part):
    stage: Coord
    chunk: Coord = 0
    micro_batch: Coord
    kind: SpanKind
    start_ms: NonNeg
    end_ms: NonNeg


class Clock(_Part):
    """How far the ranks' clocks can be trusted: per stage, its origin relative to rank 0's
    once aligned and the uncertainty of that alignment (ms); spans that start before their
    input was sent (then bubble_measured is null)."""

    order_violations: Annotated[int, Field(ge=0, le=MAX_SPANS)] = 0
    offsets_ms: list[Finite] = Field(default_factory=list, max_length=1 << 16)
    uncertainty_ms: list[NonNeg] = Field(default_factory=list, max_length=1 << 16)


class PipelineTimeline(Msg):
    type: Literal["pipeline_timeline"]
    step: Int64
    time: Finite | None = None
    schedule: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NoNul)]
    pp: Annotated[int, Field(ge=1, le=1 << 16)]
    chunks: Annotated[int, Field(ge=1, le=1 << 16)] = 1
    micro_batches: Annotated[int, Field(ge=1, le=1 << 24)]
    bubble_measured: Fraction | None = None
    bubble_formula: Fraction | None = None
    spans: list[Span] = Field(min_length=1, max_length=MAX_SPANS)
    clock: Clock = Field(default_factory=Clock)

    @model_validator(mode="after")
    def _inside(self) -> PipelineTimeline:
        for i, s in enumerate(self.spans):
            if s.end_ms < s.start_ms:
                raise ValueError(f"spans[{i}]: end_ms {s.end_ms} is before start_ms {s.start_ms}")
            if s.stage >= self.pp or s.chunk >= self.chunks or s.micro_batch >= self.micro_batches:
                raise ValueError(
                    f"spans[{i}]: stage {s.stage}, chunk {s.chunk}, micro_batch "
                    f"{s.micro_batch} outside pp={self.pp}, chunks={self.chunks}, "
                    f"micro_batches={self.micro_batches}"
                )
        kinds = {s.kind for s in self.spans}
        if len(kinds) > MAX_SPAN_KINDS:  # each kind is a colour and a legend entry
            raise ValueError(f"spans: {len(kinds)} kinds, over the limit of {MAX_SPAN_KINDS}")
        return self

    def memory_bytes(self) -> int:
        return len(self.spans) * SPAN_MEMORY


EventKind = Literal[
    "nonfinite_loss",
    "loss_spike",
    "grad_norm_spike",
    "spike_rollback",
    "throughput_drop",
    "stall",
    "straggler",
    "restart",
    "preemption",
    "evaluation_failed",  # a downstream evaluation of a checkpoint (the run goes on)
]
EVENT_KINDS = get_args(EventKind)
Severity = Literal["info", "warning", "critical"]


def _finite_json(v: dict[str, Any]) -> dict[str, Any]:
    """No NaN/inf inside details: JSON has no such numbers, and the API and the webhook
    send details on as strict JSON."""
    try:
        json.dumps(v, allow_nan=False)
    except ValueError:
        raise ValueError("holds a NaN or infinite number (send it as a string)") from None
    return v


Details = Annotated[dict[str, Any], bounded_json(MAX_DETAILS_BYTES), AfterValidator(_finite_json)]


class Event(Msg):
    type: Literal["event"]
    step: Int64 | None = None
    time: Finite | None = None
    kind: EventKind
    severity: Severity = "warning"
    message: Annotated[str, StringConstraints(min_length=1, max_length=2000, pattern=NoNul)]
    details: Details = Field(default_factory=dict)


class Sample(_Part):
    prompt: Annotated[str, StringConstraints(max_length=4000, pattern=NoNul)]
    completion: Annotated[str, StringConstraints(max_length=16_000, pattern=NoNul)]


class Samples(Msg):
    type: Literal["samples"]
    step: Int64
    time: Finite | None = None
    max_new_tokens: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    samples: list[Sample] = Field(min_length=1, max_length=MAX_SAMPLES)
