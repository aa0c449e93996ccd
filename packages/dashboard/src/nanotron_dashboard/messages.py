"""The ingest protocol: JSON messages sent by trainers, validated with pydantic.

Every message has `type` and `run_id`. NaN and +-Infinity are legal metric values (as the
JSON tokens NaN/Infinity that Python's json module writes, or as strings "nan"/"inf").
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    field_validator,
)

MAX_MESSAGE_BYTES = 1 << 20  # a message over 1 MiB is refused
INT64_MAX = 2**63 - 1  # SQLite's INTEGER; a larger number would overflow it
MAX_JSON_DEPTH = 64  # of a config or topology; deeper ones break readers that recurse
MAX_CONFIG_BYTES = 256 << 10
MAX_TOPOLOGY_BYTES = 16 << 10
MAX_METRIC_NAMES = 1000  # per run (the writer enforces it across messages)
RUN_ID_CHARS = "A-Za-z0-9._-"


def _run_id(v: str) -> str:
    if v.strip(".") == "":  # "." and ".." are path segments a browser would collapse
        raise ValueError("a run id must not consist of dots only")
    return v


# run ids appear in URLs, file names and the CSV download: a URL-safe charset
RunId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=200, pattern=rf"^[{RUN_ID_CHARS}]+$"),
    AfterValidator(_run_id),
]
Int64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
# time axes: NaN/inf would poison every x=time or x=tokens view of the run
Finite = Annotated[float, Field(allow_inf_nan=False)]
Text = Annotated[str, StringConstraints(max_length=200, pattern=r"^[^\x00]*$")]
PathText = Annotated[str, StringConstraints(max_length=4096, pattern=r"^[^\x00]*$")]
# no control characters, and no comma: `names=` lists metric names comma-separated
MetricName = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f,]+$")
]


def json_depth(value: Any) -> int:
    """Nesting depth of decoded JSON, without recursion (a hostile depth cannot overflow it)."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            depth = max(depth, d)
            if d > MAX_JSON_DEPTH:
                return d
            stack.extend((x, d + 1) for x in v)
    return depth


def _bounded_json(max_bytes: int) -> AfterValidator:
    def check(v: dict[str, Any]) -> dict[str, Any]:
        if json_depth(v) > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        size = len(json.dumps(v, default=str))
        if size > max_bytes:
            raise ValueError(f"{size} bytes as JSON, over the {max_bytes}-byte limit")
        return v

    return AfterValidator(check)


Config = Annotated[dict[str, Any], _bounded_json(MAX_CONFIG_BYTES)]
Topology = Annotated[dict[str, Any], _bounded_json(MAX_TOPOLOGY_BYTES)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_id: RunId
    # when set, the server replies {"ok": true, "type": "ack", "ack": N} once it is committed
    ack: Annotated[int, Field(ge=-(2**63), le=INT64_MAX)] | None = None


class ResumedFrom(BaseModel):
    run_id: RunId | None = None
    step: Int64 | None = None
    path: PathText | None = None


class RunStart(_Msg):
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
    attempt: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None
    time: Finite | None = None


class Metrics(_Msg):
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


class Checkpoint(_Msg):
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


class Heartbeat(_Msg):
    type: Literal["heartbeat"]
    time: Finite | None = None


class RunEnd(_Msg):
    type: Literal["run_end"]
    status: Literal["finished", "failed", "preempted"]
    error: Annotated[str, StringConstraints(max_length=100_000)] | None = None
    time: Finite | None = None


# A new message type: a model above with bounded fields, added to this union and handled in
# writer.Writer._apply.
Message = Annotated[
    RunStart | Metrics | Checkpoint | Heartbeat | RunEnd, Field(discriminator="type")
]
_adapter: TypeAdapter[Any] = TypeAdapter(Message)


class MessageError(ValueError):
    """An ingest message that is too large, not JSON, or fails validation."""


def parse_json(raw: str | bytes) -> Any:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(
            f"message of {len(raw)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit"
        )
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise MessageError(f"not valid JSON: {e}") from None
    except RecursionError:
        raise MessageError(f"not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None


AnyMessage = RunStart | Metrics | Checkpoint | Heartbeat | RunEnd


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
            return [MessageError(_one_line(e))]
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
