"""REST endpoints of the telemetry (rank stats, pipeline timelines, events, samples) and the
run's tags and note (PATCH, CSRF-protected like DELETE)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from . import queries, telemetry_queries, telemetry_store
from .api import _conn, _write
from .heatmap import heavy_read
from .messages import INT64_MAX
from .security import require_csrf
from .telemetry_messages import EVENT_KINDS, RANK_FIELDS
from .telemetry_queries import MAX_FIELDS

router = APIRouter()
MAX_LABELS_BODY = 64 << 10
MAX_TAGS = 32
Step = Annotated[int, Query(ge=0, le=INT64_MAX)]


def _pk(request: Request, run_id: str) -> int:
    with _conn(request) as c:
        return int(queries.run_row(c, run_id).pk)


def _json(body: Any) -> Response:
    # json.dumps directly: FastAPI's generic encoder walks every float (slow on a heatmap)
    return Response(json.dumps(body, allow_nan=False), media_type="application/json")


@router.get("/api/runs/{run_id}/rank_stats", tags=["telemetry"])
def rank_stats(
    request: Request,
    run_id: str,
    from_step: Step | None = None,
    to_step: Step | None = None,
    max_steps: int = Query(200, ge=1, le=5000),
    fields: str | None = Query(
        None, description=f"comma-separated, at most {MAX_FIELDS}; default all"
    ),
) -> Response:
    """The heatmap: per field, a grid of intervals (`steps`) x ranks (`ranks`, with their
    coordinates and host), at most `max_steps` intervals evenly spaced (and the newest), at
    most a million numbers (an interval alone over that is a 400: ask for fewer fields)."""
    wanted = [f for f in fields.split(",") if f] if fields else list(RANK_FIELDS)
    with heavy_read(), _conn(request) as c:
        pk = queries.run_row(c, run_id).pk
        head = {"run_id": run_id}
        body = telemetry_queries.rank_stats(c, pk, from_step, to_step, max_steps, wanted, head)
    return Response(body, media_type="application/json")


@router.get("/api/runs/{run_id}/timelines", tags=["telemetry"])
def timelines(
    request: Request, run_id: str, limit: int = Query(1000, ge=1, le=10_000)
) -> list[dict[str, Any]]:
    """The steps with a recorded pipeline timeline (newest `limit`), without their spans."""
    with _conn(request) as c:
        return telemetry_queries.timelines(c, queries.run_row(c, run_id).pk, limit)


@router.get("/api/runs/{run_id}/timelines/{step}", tags=["telemetry"])
def timeline(request: Request, run_id: str, step: int) -> Response:
    with _conn(request) as c:
        pk = queries.run_row(c, run_id).pk
        found = telemetry_queries.timeline(c, pk, step) if 0 <= step <= INT64_MAX else None
    if found is None:
        raise HTTPException(404, f"run {run_id!r} has no pipeline timeline at step {step}")
    return _json({"run_id": run_id, **found})


@router.get("/api/runs/{run_id}/events", tags=["telemetry"])
def events(
    request: Request,
    run_id: str,
    kind: str | None = Query(None, description=f"one of {', '.join(EVENT_KINDS)}"),
    limit: int = Query(1000, ge=1, le=10_000),
) -> list[dict[str, Any]]:
    """The run's events (from the trainer, and restart/stall derived by the dashboard)."""
    if kind is not None and kind not in EVENT_KINDS:
        raise HTTPException(422, f"kind must be one of {', '.join(EVENT_KINDS)}")
    with _conn(request) as c:
        pk = queries.run_row(c, run_id).pk
        return telemetry_queries.events(c, pk, run_id, kind, limit)


@router.get("/api/runs/{run_id}/samples", tags=["telemetry"])
def samples(
    request: Request, run_id: str, limit: int = Query(20, ge=1, le=200)
) -> list[dict[str, Any]]:
    """Generated samples of the newest `limit` checkpoints, oldest first."""
    with _conn(request) as c:
        return telemetry_queries.samples(c, queries.run_row(c, run_id).pk, limit)


Tag = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._:-]{1,64}$")]


class Labels(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[Tag] | None = Field(None, max_length=MAX_TAGS)
    note: Annotated[str, StringConstraints(max_length=10_000, pattern=r"^[^\x00]*$")] | None = None


async def _labels_body(request: Request) -> Labels:
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != (
        "application/json"
    ):
        raise HTTPException(415, "send the tags and note as Content-Type: application/json")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LABELS_BODY:
            raise HTTPException(413, f"body over the {MAX_LABELS_BODY}-byte limit")
    try:
        labels = Labels.model_validate_json(body)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise HTTPException(422, problems[:2000]) from None
    if labels.tags is None and labels.note is None:
        raise HTTPException(422, 'send "tags" (a list) and/or "note" (a string)')
    return labels


@router.patch("/api/runs/{run_id}", tags=["runs"], dependencies=[Depends(require_csrf)])
async def edit_labels(request: Request, run_id: str) -> dict[str, Any]:
    """Replace the run's tags (each `[A-Za-z0-9._:-]{1,64}`, at most 32) and/or its note
    (at most 10,000 characters). Needs the page's X-CSRF-Token."""
    labels = await _labels_body(request)
    tags = None if labels.tags is None else list(dict.fromkeys(labels.tags))

    def edit() -> dict[str, Any]:  # blocking (database, writer): off the event loop
        pk = _pk(request, run_id)  # 404 first
        return _write(request, lambda conn: telemetry_store.set_labels(conn, pk, tags, labels.note))

    res = await asyncio.to_thread(edit)
    request.app.state.hub.notify({}, {run_id})
    return {"id": run_id, **res}
