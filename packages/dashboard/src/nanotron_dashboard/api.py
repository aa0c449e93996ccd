"""REST endpoints under /api and the two pages."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from sqlalchemy.exc import DBAPIError
from starlette.requests import ClientDisconnect

from . import csv_export, queries
from .auth import OWNER, auth_level, level_name
from .checkpoints import scan_checkpoints
from .db import delete_run
from .errors import DashboardError
from .launch import AlreadyRunning, NotGranted, plan
from .memory import account
from .outage import is_unavailable, unavailable
from .security import csrf_allowed, require_csrf
from .store import is_disk_full, upsert_checkpoint

router = APIRouter()
STATIC = Path(__file__).parent / "static"
log = logging.getLogger("nanotron_dashboard")


def _conn(request: Request) -> Any:
    return request.app.state.engine.connect()


def _write(request: Request, job: Any) -> Any:
    """Run a write on the single writer; its refusal (a full disk: 507) becomes the answer."""
    res = request.app.state.writer.submit(job, want_result=True).result(timeout=60)
    if isinstance(res, dict) and res.get("ok") is False:
        retry = {"Retry-After": str(res["retry_after"])} if "retry_after" in res else None
        raise HTTPException(res["status"], res["error"], headers=retry)
    return res


def _stall(request: Request) -> float:
    return request.app.state.settings.stall_seconds


@router.get("/", include_in_schema=False)
def page_runs() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.get("/runs/{run_id}", include_in_schema=False)
def page_run(run_id: str) -> FileResponse:
    del run_id  # the page reads it from its URL
    return FileResponse(STATIC / "run.html")


@router.get("/docs", include_in_schema=False)
def page_docs() -> FileResponse:
    """The API reference, drawn from /openapi.json by a local script (no CDN)."""
    return FileResponse(STATIC / "docs.html")


@router.get("/api/session", tags=["runs"])
def session(request: Request) -> dict[str, Any]:
    """What the pages need: whether this request may launch, the CSRF token for
    state-changing requests (only to a request that proved a credential, or to anyone when
    the server has none), the stall threshold. Never to another site's page: a browser marks
    a request from another site with Sec-Fetch-Site."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise HTTPException(403, "the session is served to the dashboard's own pages only")
    s = request.app.state.settings
    level = auth_level(request.scope)
    return {
        "allow_launch": s.allow_launch and level == OWNER,
        "signed_in_as": level_name(level),
        "csrf": request.app.state.csrf if csrf_allowed(request) else None,
        "stall_seconds": s.stall_seconds,
    }


@router.get("/api/memory", tags=["server"])
def memory(request: Request) -> dict[str, Any]:
    """Bytes held by each bounded part of the server, their caps, and the process's RSS."""
    return account(request.app.state)


@router.get("/api/runs", tags=["runs"])
def runs(
    request: Request,
    project: str | None = None,
    status: Literal["running", "finished", "failed", "preempted", "stalled"] | None = None,
    name: str | None = None,
    ids: str | None = Query(None, description="comma-separated run ids (at most 1000)"),
    limit: int = Query(100, ge=1, le=1000),
    cursor: str | None = Query(None, description="X-Next-Cursor of the previous page"),
    tag: str | None = Query(None, max_length=64, description="only runs with this tag"),
) -> JSONResponse:
    """Newest first, one page of `limit` runs; the header X-Next-Cursor (and a Link rel=next)
    names the next page, absent on the last one."""
    id_list = [i for i in ids.split(",") if i][:1000] if ids else None
    with _conn(request) as c:
        page, nxt = queries.list_runs(
            c, _stall(request), project, status, name, id_list, limit, cursor, tag
        )
    headers = {}
    if nxt:
        params = dict(request.query_params) | {"cursor": nxt}
        query = "&".join(f"{quote(k)}={quote(v)}" for k, v in params.items())
        headers = {"X-Next-Cursor": nxt, "Link": f'</api/runs?{query}>; rel="next"'}
    return JSONResponse(page, headers=headers)


@router.get("/api/runs/{run_id}", tags=["runs"])
def run(request: Request, run_id: str) -> dict[str, Any]:
    with _conn(request) as c:
        return queries.get_run(c, run_id, _stall(request))


@router.delete("/api/runs/{run_id}", tags=["runs"], dependencies=[Depends(require_csrf)])
def remove_run(request: Request, run_id: str) -> dict[str, Any]:
    """Delete a run and its series (not its checkpoint files). Needs the X-CSRF-Token."""
    state = request.app.state
    with _conn(request) as c:
        queries.run_row(c, run_id)  # 404 first
    pk = _write(request, lambda conn: delete_run(conn, run_id))
    if pk is None:
        raise queries.NotFound(f"run {run_id!r} not found")
    state.cache.drop_run(pk)
    state.hub.notify({}, {run_id})
    return {"deleted": run_id}


METRIC_POINTS = 250_000  # points in one metrics response, all series together (x4 numbers)


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
    known = info["metric_names"]
    if names:
        asked = list(dict.fromkeys(n for n in names.split(",") if n))
        have = set(known)
        # unknown names are reported, never looked up (nor cached as empty series)
        wanted = [n for n in asked if n in have]
        unknown = [n for n in asked if n not in have][:100]
    else:
        wanted, unknown = known, []
    # The response is bounded whatever is stored: max_points is per series, so many names
    # share METRIC_POINTS between them (1,000 names x 50,000 points would be 200M numbers).
    per_series = min(max_points, max(8, METRIC_POINTS // max(1, len(wanted))))
    series = queries.metric_series(
        request.app.state.cache, row.pk, wanted, x, per_series, smoothing, row.started
    )
    # json.dumps directly: FastAPI's generic encoder walks every float (slow at 4 x 2000 points)
    body = {"run_id": run_id, "x": x, "smoothing": smoothing, "series": series, "unknown": unknown}
    return Response(json.dumps(body, allow_nan=False), media_type="application/json")


def attachment(filename: str) -> str:
    """Content-Disposition with an ASCII fallback and the exact name as RFC 5987 `filename*`."""
    ascii_name = "".join(
        ch if ch.isascii() and (ch.isalnum() or ch in "-_.") else "_" for ch in filename
    )
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename, safe='')}"


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
            yield from csv_export.csv_rows(conn, run_id, wanted)
        finally:
            conn.close()

    return StreamingResponse(
        body(),
        media_type="text/csv; charset=utf-8",
        headers={"content-disposition": attachment(f"{run_id}.csv")},
    )


def _on_disk(request: Request, row: Any) -> list[Any]:
    return scan_checkpoints(row.checkpoints_path, row.cwd) if row.checkpoints_path else []


@router.get("/api/runs/{run_id}/checkpoints", tags=["checkpoints"])
def checkpoints(request: Request, run_id: str) -> list[dict[str, Any]]:
    """Stored checkpoints and those found under the run's checkpoints path; read-only."""
    with _conn(request) as c:
        row = queries.run_row(c, run_id)
        return queries.list_checkpoints(c, run_id, _on_disk(request, row))


@router.post(
    "/api/runs/{run_id}/checkpoints/scan",
    tags=["checkpoints"],
    dependencies=[Depends(require_csrf)],
)
def scan(request: Request, run_id: str) -> list[dict[str, Any]]:
    """Store the checkpoints found on disk (written while the dashboard was down), so that
    they get ids to resume from. The run page calls it; needs the X-CSRF-Token."""
    with _conn(request) as c:
        row = queries.run_row(c, run_id)
    found = _on_disk(request, row)
    if found:

        def job(conn: Any) -> None:
            for ck in found:
                upsert_checkpoint(conn, row.pk, **ck.__dict__, source="disk")

        _write(request, job)
    with _conn(request) as c:
        return queries.list_checkpoints(c, run_id)


@router.get("/api/diff", tags=["runs"])
def diff(request: Request, a: str, b: str) -> dict[str, Any]:
    """The config keys (dotted) whose values differ between runs a and b."""
    with _conn(request) as c:
        return queries.config_diff(c, a, b)


@router.post(
    "/api/checkpoints/{checkpoint_id}/resume",
    tags=["checkpoints"],
    dependencies=[Depends(require_csrf)],
)
def resume(request: Request, checkpoint_id: int) -> JSONResponse:
    """Start the resume command of a listed checkpoint (--allow-launch, the launch token).

    The request names a checkpoint id only; the command and cwd are the run's launch grant
    (sent by a trainer holding the launch token), the checkpoint must lie in its checkpoints
    path. 409 while a previous launch of the same checkpoint still runs."""
    state = request.app.state
    if not state.settings.allow_launch:
        raise HTTPException(403, "launching is disabled: start the dashboard with --allow-launch")
    if auth_level(request.scope) != OWNER:
        raise HTTPException(403, "launching needs the launch token: open /?token=<launch token>")
    if not 0 <= checkpoint_id < 2**63:
        raise HTTPException(404, f"checkpoint {checkpoint_id} not found")
    with _conn(request) as c:
        p = plan(c, checkpoint_id, state.grants)
    if p is None:
        raise HTTPException(404, f"checkpoint {checkpoint_id} not found")
    # the child is the owner's trainer: it streams, and its own run becomes launchable
    env = {"NANOTRON_DASHBOARD_URL": state.settings.public_url}
    env["NANOTRON_DASHBOARD_TOKEN"] = state.settings.launch_token
    launched = state.launcher.launch(checkpoint_id, p.command, p.cwd, p.checkpoint, env)
    return JSONResponse(
        {
            "pid": launched.pid,
            "argv": launched.argv,
            "cwd": launched.cwd,
            "log": launched.log,
            "parent_run": p.run_id,
        },
        202,
    )


def error_handlers(app: Any) -> None:
    @app.exception_handler(queries.NotFound)
    async def _nf(_r: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, 404)

    @app.exception_handler(AlreadyRunning)
    async def _busy(_r: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, 409)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_r: Request, _e: Exception) -> Response:
        # the client closed mid-upload: nobody reads an answer, and it is no server error
        return Response(status_code=400)

    @app.exception_handler(NotGranted)
    async def _barred(_r: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, 403)

    @app.exception_handler(DashboardError)
    async def _bad(_r: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, 400)

    @app.exception_handler(DBAPIError)
    async def _database(r: Request, e: Exception) -> JSONResponse:
        # a handler of its own: Starlette re-raises what the Exception handler answered, and
        # uvicorn then logs a traceback per request (an outage's flood)
        if is_unavailable(e):  # one log line per outage (outage.py), not one per request
            r.app.state.writer.outage.failed(e)
            res = unavailable(e)
            headers = {"Retry-After": str(res["retry_after"])}
            return JSONResponse({"detail": res["error"]}, 503, headers=headers)
        return await _other(r, e)

    @app.exception_handler(Exception)
    async def _other(r: Request, e: Exception) -> JSONResponse:
        if is_disk_full(e):
            return JSONResponse({"detail": "the dashboard's disk is full; retry later"}, 507)
        log.error("dashboard: %s %s failed: %s: %s", r.method, r.url.path, type(e).__name__, e)
        return JSONResponse({"detail": f"internal error: {type(e).__name__}"}, 500)
