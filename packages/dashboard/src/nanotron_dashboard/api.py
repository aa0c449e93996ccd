"""REST endpoints under /api and the two pages."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from . import queries
from .checkpoints import scan_checkpoints
from .errors import DashboardError
from .launch import launch_resume
from .security import same_origin
from .writer import upsert_checkpoint

router = APIRouter()
STATIC = Path(__file__).parent / "static"


def _conn(request: Request) -> Any:
    return request.app.state.engine.connect()


def _stall(request: Request) -> float:
    return request.app.state.settings.stall_seconds


@router.get("/", include_in_schema=False)
def page_runs() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.get("/runs/{run_id}", include_in_schema=False)
def page_run(run_id: str) -> FileResponse:
    del run_id  # the page reads it from its URL
    return FileResponse(STATIC / "run.html")


@router.get("/api/session", tags=["runs"])
def session(request: Request) -> dict[str, Any]:
    """What the pages need: whether launching is allowed, and the CSRF token for it."""
    s = request.app.state.settings
    return {
        "allow_launch": s.allow_launch,
        "csrf": request.app.state.csrf if s.allow_launch else None,
    }


@router.get("/api/runs", tags=["runs"])
def runs(
    request: Request,
    project: str | None = None,
    status: Literal["running", "finished", "failed", "stalled"] | None = None,
    name: str | None = None,
    ids: str | None = Query(None, description="comma-separated run ids"),
) -> list[dict[str, Any]]:
    with _conn(request) as c:
        id_list = [i for i in ids.split(",") if i] if ids else None
        return queries.list_runs(c, _stall(request), project, status, name, id_list)


@router.get("/api/runs/{run_id}", tags=["runs"])
def run(request: Request, run_id: str) -> dict[str, Any]:
    with _conn(request) as c:
        return queries.get_run(c, run_id, _stall(request))


@router.get("/api/runs/{run_id}/metrics", tags=["metrics"])
def metrics(
    request: Request,
    run_id: str,
    names: str | None = Query(None, description="comma-separated; default all"),
    max_points: int = Query(2000, ge=8, le=50_000),
    x: Literal["step", "tokens", "time"] = "step",
    smoothing: float = Query(0.0, ge=0.0, lt=1.0, description="EMA weight on the full series"),
) -> Response:
    with _conn(request) as c:
        row = queries.run_row(c, run_id)
        info = queries.get_run(c, run_id, _stall(request))
    wanted = [n for n in names.split(",") if n] if names else info["metric_names"]
    series = queries.metric_series(
        request.app.state.cache, row.pk, wanted, x, max_points, smoothing, row.started
    )
    # json.dumps directly: FastAPI's generic encoder walks every float (slow at 4 x 2000 points)
    body = {"run_id": run_id, "x": x, "smoothing": smoothing, "series": series}
    return Response(json.dumps(body, allow_nan=False), media_type="application/json")


@router.get("/api/runs/{run_id}/metrics.csv", tags=["metrics"])
def metrics_csv(request: Request, run_id: str, names: str | None = None) -> StreamingResponse:
    conn = _conn(request)
    try:
        queries.run_row(conn, run_id)
    except Exception:
        conn.close()
        raise
    wanted = [n for n in names.split(",") if n] if names else None

    def body() -> Any:
        try:
            yield from queries.csv_rows(conn, run_id, wanted)
        finally:
            conn.close()

    filename = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run_id)
    return StreamingResponse(
        body(),
        media_type="text/csv",
        headers={"content-disposition": f'attachment; filename="{filename}.csv"'},
    )


@router.get("/api/runs/{run_id}/checkpoints", tags=["checkpoints"])
def checkpoints(request: Request, run_id: str) -> list[dict[str, Any]]:
    with _conn(request) as c:
        row = queries.run_row(c, run_id)
    if row.checkpoints_path:  # checkpoints written while the dashboard was down
        found = scan_checkpoints(row.checkpoints_path, row.cwd)
        if found:

            def job(conn: Any) -> None:
                for ck in found:
                    upsert_checkpoint(conn, row.pk, **ck.__dict__, source="disk")

            request.app.state.writer.submit(job, want_result=True).result(timeout=30)
    with _conn(request) as c:
        return queries.list_checkpoints(c, run_id)


@router.get("/api/diff", tags=["runs"])
def diff(request: Request, a: str, b: str) -> dict[str, Any]:
    """The config keys (dotted) whose values differ between runs a and b."""
    with _conn(request) as c:
        return queries.config_diff(c, a, b)


@router.post("/api/checkpoints/{checkpoint_id}/resume", tags=["checkpoints"])
def resume(request: Request, checkpoint_id: int) -> JSONResponse:
    """Start the stored resume command of a listed checkpoint (only with --allow-launch)."""
    state = request.app.state
    if not state.settings.allow_launch:
        raise HTTPException(403, "launching is disabled: start the dashboard with --allow-launch")
    headers = {k.lower(): v for k, v in request.headers.items()}
    if not same_origin(headers) or not secrets.compare_digest(
        headers.get("x-csrf-token", ""), state.csrf
    ):
        raise HTTPException(403, "cross-site request refused (missing or wrong X-CSRF-Token)")
    with _conn(request) as c:
        ck = c.exec_driver_sql(
            "SELECT c.path, r.id FROM checkpoints c JOIN runs r ON r.pk=c.run_pk WHERE c.id=?",
            (checkpoint_id,),
        ).first()
        if ck is None:
            raise HTTPException(404, f"checkpoint {checkpoint_id} not found")
        row = queries.run_row(c, ck[1])
    env = {"NANOTRON_DASHBOARD_URL": state.settings.public_url}
    if state.settings.token:
        env["NANOTRON_DASHBOARD_TOKEN"] = state.settings.token
    launched = launch_resume(json.loads(row.command), row.cwd, ck[0], state.launch_dir, env)
    return JSONResponse(
        {
            "pid": launched.pid,
            "argv": launched.argv,
            "cwd": launched.cwd,
            "log": launched.log,
            "parent_run": ck[1],
        },
        202,
    )


def error_handlers(app: Any) -> None:
    @app.exception_handler(queries.NotFound)
    async def _nf(_r: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, 404)

    @app.exception_handler(DashboardError)
    async def _bad(_r: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, 400)
