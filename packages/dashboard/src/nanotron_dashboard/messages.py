"""The ingest protocol: JSON messages sent by trainers, validated with pydantic.

Every message has `type` and `run_id`. NaN and +-Infinity are legal metric values (as the
JSON tokens NaN/Infinity that Python's json module writes, or as strings "nan"/"inf").
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, field_validator

from .fields import (  # noqa: F401 - re-exported: other modules import the limits from here
    INT64_MAX,
    MAX_CONFIG_BYTES,
    MAX_JSON_DEPTH,
    MAX_MESSAGE_BYTES,
    MAX_METRIC_NAMES,
    NO_NUL,
    Config,
    Finite,
    Int64,
    MetricName,
    Msg,
    PathText,
    RunId,
    Text,
    Topology,
    json_depth,
)
from .layer_messages import LayerStats
from .moe_messages import MoELoad
from .prediction_messages import Prediction
from .telemetry_messages import Event, PipelineTimeline, RankStats, Samples


class ResumedFrom(BaseModel):
    run_id: RunId | None = None
    step: Int64 | None = None
    path: PathText | None = None


class RunStart(Msg):
    type: Literal["run_start"]
    project: Text = ""
    name: Text = ""
    config: Config = Field(default_factory=dict)
    world_size: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    topology: Topology = Field(default_factory=dict)
    host: Text | None = None
    command: list[PathText] = Field(default_factory=list, max_length=1000)
    cwd: PathText | None = None
    checkpoints_path: PathText | None = None
    resumed_from: ResumedFrom | None = None
    # One token per launch: a run continued by a restarted launch has several attempts.
    attempt: (
        Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)] | None
    ) = None
    time: Finite | None = None


class Metrics(Msg):
    type: Literal["metrics"]
    step: Int64
    # NaN/inf values are real training events: stored and shown
    values: dict[MetricName, float] = Field(max_length=MAX_METRIC_NAMES)
    time: Finite | None = None

    @field_validator("values")
    @classmethod
    def _not_empty(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("values must hold at least one metric")
        ct = v.get("consumed_tokens")
        if ct is not None and not math.isfinite(ct):  # the x=tokens axis
            raise ValueError(f"consumed_tokens must be finite, got {ct}")
        return v


class Checkpoint(Msg):
    type: Literal["checkpoint"]
    step: Int64
    path: Annotated[PathText, Field(min_length=1)]
    consumed_tokens: Int64 | None = None
    consumed_samples: Int64 | None = None
    topology: Topology = Field(default_factory=dict)
    size: Int64 | None = None
    complete: bool = True
    created: Finite | None = None
    model_config = ConfigDict(extra="ignore")  # the trainer may add fields of its metadata


class Heartbeat(Msg):
    type: Literal["heartbeat"]
    time: Finite | None = None


class RunEnd(Msg):
    type: Literal["run_end"]
    status: Literal["finished", "failed", "preempted"]
    error: Annotated[str, StringConstraints(max_length=100_000)] | None = None
    time: Finite | None = None


# A new message type: a model above with bounded fields, added to this union, and its entry
# in writer_handlers.Handlers.table (docs/internals-dashboard.md).
AnyMessage = (
    RunStart
    | Metrics
    | Checkpoint
    | Heartbeat
    | RunEnd
    | RankStats
    | PipelineTimeline
    | Event
    | Samples
    | MoELoad
    | LayerStats
    | Prediction
)
Message = Annotated[AnyMessage, Field(discriminator="type")]
_adapter: TypeAdapter[Any] = TypeAdapter(Message)


class MessageError(ValueError):
    """An ingest message that is too large, not JSON, or fails validation."""

    def __init__(self, text: str, not_json: bool = False) -> None:
        super().__init__(text)
        self.not_json = not_json  # the body is not JSON at all (HTTP: 400, not 422)


def parse_json(raw: str | bytes) -> Any:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(
            f"message of {len(raw)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit"
        )
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise MessageError(f"not valid JSON: {e}", not_json=True) from None
    except RecursionError:
        raise MessageError(
            f"not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels", not_json=True
        ) from None


def _one_line(e: Exception) -> str:
    """A pydantic ValidationError as `field: problem; ...` (one line, bounded)."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            parts = []
            for err in errors():
                loc = ".".join(str(x) for x in err["loc"][1:])  # [0] is the message type
                parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
            return "; ".join(parts)[:2000]
        except Exception:
            pass
    return " ".join(str(e).split())[:2000]


def validate(obj: Any) -> AnyMessage:
    """Validate one decoded message."""
    try:
        msg = _adapter.validate_python(obj)
    except Exception as e:  # pydantic.ValidationError: report it as one line
        raise MessageError(_one_line(e)) from None
    return _stamp(msg)


def parse_messages(raw: str | bytes) -> list[AnyMessage | MessageError]:
    """One message or a JSON list of them; each item is a message or the error it caused.

    A single object is parsed and validated in one pass by pydantic-core (5x faster than
    json.loads + validation), which is the ingest hot path.
    """
    if len(raw) > MAX_MESSAGE_BYTES:
        return [
            MessageError(f"message of {len(raw)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
        ]
    head = raw.lstrip()[:1]
    if head not in ("[", b"["):
        try:
            return [_stamp(_adapter.validate_json(raw))]
        except Exception as e:
            errors = getattr(e, "errors", None)
            bad_json = callable(errors) and any(x["type"] == "json_invalid" for x in errors())
            return [MessageError(_one_line(e), not_json=bad_json)]
    try:
        items = parse_json(raw)
    except MessageError as e:
        return [e]
    if not isinstance(items, list):
        return [MessageError("expected a message object or a JSON list of them")]
    out: list[AnyMessage | MessageError] = []
    for obj in items:
        try:
            out.append(validate(obj))
        except MessageError as e:
            out.append(e)
    return out


def _stamp(msg: Any) -> Any:
    if hasattr(msg, "time") and msg.time is None:
        msg.time = time.time()
    return msg


def json_float(v: float | None) -> float | str | None:
    """A float for a JSON response: NaN/inf become strings (JSON has no such numbers)."""
    if v is None:
        return "NaN"  # stored NULL is NaN
    if math.isfinite(v):
        return v
    if math.isnan(v):
        return "NaN"
    return "Infinity" if v > 0 else "-Infinity"
