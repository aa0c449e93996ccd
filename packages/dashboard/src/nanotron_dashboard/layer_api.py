"""REST endpoint of the per-layer statistics heatmap (runs with `metrics_logging.log_level: 1`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from . import layer_departures, layer_store, queries
from .api import _conn
from .heatmap import heavy_read
from .layer_messages import StatName
from .telemetry_api import Step

router = APIRouter()


@router.get("/api/runs/{run_id}/layer_stats", tags=["telemetry"])
def layer_stats(
    request: Request,
    run_id: str,
    stat: Annotated[
        StatName | None, Query(description="default: grad_norm, else the first")
    ] = None,
    from_step: Step | None = None,
    to_step: Step | None = None,
    max_steps: int = Query(400, ge=1, le=5000),
) -> Response:
    """One statistic per layer at the detail steps (`values[j][i]`: step `steps[j]`, row
    `rows[i]`; null where none, "NaN"/"Infinity" when not finite), at most `max_steps` steps
    evenly spaced (and the newest); `stats` lists the run's statistics. At most 500,000
    values: steps x the most rows a step of the range has."""
    with heavy_read(), _conn(request) as c:
        pk = queries.run_row(c, run_id).pk
        head = {"run_id": run_id}
        body = layer_store.layer_stats(c, pk, stat, from_step, to_step, max_steps, head)
    return Response(body, media_type="application/json")


@router.get("/api/runs/{run_id}/layer_stats/moved_first", tags=["telemetry"])
def moved_first(
    request: Request,
    run_id: str,
    step: Step,
    stat: Annotated[
        StatName | None, Query(description="default: grad_norm, else the first")
    ] = None,
    lead: int = Query(3, ge=1, le=layer_departures.MAX_LEAD),
    baseline: int = Query(8, ge=2, le=layer_departures.MAX_BASELINE),
    threshold: float = Query(3.0, gt=0, le=1e6, allow_inf_nan=False),
) -> Response:
    """The rows of one statistic ranked by how early and how far each departed from its own
    baseline before step `step` (an alert's): the `lead` detail steps at or before it against
    the `baseline` detail steps before those, in units of the baseline's robust spread
    (layer_departures.py, docs/dashboard.md). `from_step`/`to_step`: a heatmap window centred
    on the step."""
    with heavy_read(), _conn(request) as c:
        pk = queries.run_row(c, run_id).pk
        head = {"run_id": run_id}
        body = layer_departures.moved_first(c, pk, stat, step, lead, baseline, threshold, head)
    return JSONResponse(body)
