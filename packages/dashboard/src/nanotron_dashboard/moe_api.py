"""REST endpoint of the expert load heatmap (mixture-of-experts runs)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from . import moe_store, queries
from .api import _conn
from .telemetry_api import Step, _json

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
    lists the run's MoE layers."""
    with _conn(request) as c:
        pk = queries.run_row(c, run_id).pk
        body = moe_store.moe_load(c, pk, layer, from_step, to_step, max_steps)
    return _json({"run_id": run_id, **body})
