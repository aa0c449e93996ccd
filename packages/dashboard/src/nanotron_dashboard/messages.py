"""The ingest protocol: JSON messages sent by trainers, validated with pydantic.

Every message has `type` and `run_id`. NaN and +-Infinity are legal metric values (as the
JSON tokens NaN/Infinity that Python's json module writes, or as strings "nan"/"inf").
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

RunId = Annotated[str, Field(min_length=1, max_length=200)]
MAX_MESSAGE_BYTES = 1 << 20  # a message over 1 MiB is refused


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_id: RunId
    # when set, the server replies {"ok": true, "type": "ack", "ack": N} once it is committed
    ack: int | None = None


class ResumedFrom(BaseModel):
    run_id: str | None = None
    step: int | None = None
    path: str | None = None


class RunStart(_Msg):
    type: Literal["run_start"]
    project: str = Field(default="", max_length=200)
    name: str = Field(default="", max_length=200)
    config: dict[str, Any] = Field(default_factory=dict)
    world_size: int | None = Field(default=None, ge=1)
    topology: dict[str, Any] = Field(default_factory=dict)
    host: str | None = None
    command: list[str] = Field(default_factory=list)
    cwd: str | None = None
    checkpoints_path: str | None = None
    resumed_from: ResumedFrom | None = None
    time: float | None = None


class Metrics(_Msg):
    type: Literal["metrics"]
    step: int = Field(ge=0)
    values: dict[Annotated[str, Field(min_length=1, max_length=100)], float]
    time: float | None = None

    @field_validator("values")
    @classmethod
    def _not_empty(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("values must hold at least one metric")
        return v


class Checkpoint(_Msg):
    type: Literal["checkpoint"]
    step: int = Field(ge=0)
    path: str = Field(min_length=1)
    consumed_tokens: int | None = None
    consumed_samples: int | None = None
    topology: dict[str, Any] = Field(default_factory=dict)
    size: int | None = Field(default=None, ge=0)
    complete: bool = True
    created: float | None = None
    model_config = ConfigDict(extra="ignore")  # the trainer may add fields of its metadata


class Heartbeat(_Msg):
    type: Literal["heartbeat"]
    time: float | None = None


class RunEnd(_Msg):
    type: Literal["run_end"]
    status: Literal["finished", "failed"]
    error: str | None = Field(default=None, max_length=100_000)
    time: float | None = None


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


AnyMessage = RunStart | Metrics | Checkpoint | Heartbeat | RunEnd


def validate(obj: Any) -> AnyMessage:
    """Validate one decoded message."""
    try:
        msg = _adapter.validate_python(obj)
    except Exception as e:  # pydantic.ValidationError: report it as one line
        raise MessageError(" ".join(str(e).split())[:2000]) from None
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
            return [MessageError(" ".join(str(e).split())[:2000])]
    try:
        items = parse_json(raw)
    except MessageError as e:
        return [e]
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
