"""REST endpoint of the planner's prediction of a run next to what the run measured."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from . import prediction_store, queries
from .api import _conn

router = APIRouter()


@router.get("/api/runs/{run_id}/prediction", tags=["telemetry"])
def prediction(request: Request, run_id: str) -> Response:
    """The layout planner's prediction for the run's layout (`predicted`: peak memory of the
    worst rank, step time and its parts in ms; null when the trainer sent none), what the
    run's rank_stats measured of the same (`measured`: each phase's mean over ranks, the
    median over intervals after the first; the largest peak memory), and per part the ratio
    predicted / measured and `off` when they differ by more than `off_threshold`."""
    with _conn(request) as c:
        pk = queries.run_row(c, run_id).pk
        body = {"run_id": run_id, **prediction_store.prediction(c, pk)}
    return Response(json.dumps(body, allow_nan=False), media_type="application/json")
