"""The bounded field types every ingest message is built from (pydantic annotations)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

MAX_MESSAGE_BYTES = 1 << 20  # a message over 1 MiB is refused
INT64_MAX = 2**63 - 1  # SQLite's INTEGER; a larger number would overflow it
MAX_JSON_DEPTH = 64  # of a config or topology; deeper ones break readers that recurse
MAX_CONFIG_BYTES = 256 << 10
MAX_TOPOLOGY_BYTES = 16 << 10
MAX_METRIC_NAMES = 1000  # per run (the writer enforces it across messages)
MAX_DETAILS_BYTES = 16 << 10  # an event's details
MAX_RANKS = 65_536  # entries of one rank_stats message
MAX_SPANS = 100_000  # spans of one pipeline_timeline message
MAX_SPAN_KINDS = 16  # distinct span kinds in one pipeline_timeline message
MAX_SAMPLES = 64
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
# No NUL in any text a message brings: PostgreSQL's text cannot hold one (SQLite's can), and
# both backends refuse the same (tests/dashboard/test_nul_bytes.py walks every message).
NO_NUL = r"^[^\x00]*$"
Text = Annotated[str, StringConstraints(max_length=200, pattern=NO_NUL)]
PathText = Annotated[str, StringConstraints(max_length=4096, pattern=NO_NUL)]
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


def bounded_json(max_bytes: int) -> AfterValidator:
    def check(v: dict[str, Any]) -> dict[str, Any]:
        if json_depth(v) > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        size = len(json.dumps(v, default=str))
        if size > max_bytes:
            raise ValueError(f"{size} bytes as JSON, over the {max_bytes}-byte limit")
        return v

    return AfterValidator(check)


Config = Annotated[dict[str, Any], bounded_json(MAX_CONFIG_BYTES)]
Topology = Annotated[dict[str, Any], bounded_json(MAX_TOPOLOGY_BYTES)]


class Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_id: RunId
    # when set, the server replies {"ok": true, "type": "ack", "ack": N} once it is committed
    ack: Annotated[int, Field(ge=-(2**63), le=INT64_MAX)] | None = None
