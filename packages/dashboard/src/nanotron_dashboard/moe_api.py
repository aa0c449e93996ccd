"""REST endpoint of the expert load heatmap (mixture-of-experts runs)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from . import moe_store, queries
from .api import _conn
from .heatmap import heavy_read
from .telemetry_api import Step

router = APIRouter()


@router.get("/api/runs/{run_id}/moe_load", tags=["telemetry"])
def moe_load(
    request: Request,
    run_id: str,
    layer: int | None = Query(None, ge=0, lt=1 << 16, description="default: the first"),
    from_step: Step | None = None,
    to_step: Step | None = None,
    max_steps: int = Query(400, ge=1, le=5000),
) -> Response:
    """One MoE layer's tokens per expert at the logged steps (`counts[j][e]`: step
    `steps[j]`, expert e), at most `max_steps` steps evenly spaced (and the newest); `layers`
    lists the run's MoE layers. At most 500,000 counts: steps x the most experts a step of
    the range has."""
    with heavy_read(), _conn(request) as c:
        pk = queries.run_row(c, run_id).pk
        head = {"run_id": run_id}
        body = moe_store.moe_load(c, pk, layer, from_step, to_step, max_steps, head)
    return Response(body, media_type="application/json")
