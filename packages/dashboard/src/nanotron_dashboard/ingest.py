"""Ingest over /ws/ingest and POST /api/ingest, and the browsers' live feeds."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from concurrent.futures import Future
from typing import Any

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from .auth import OWNER, auth_level
from .grants import grant_job
from .messages import MAX_MESSAGE_BYTES, MessageError, RunStart, parse_messages
from .outage import RETRY_AFTER_S as OUTAGE_RETRY_S
from .store import refusal

router = APIRouter()
RETRY_AFTER_S = 1
# A parsed message (pydantic model, its dict, floats, strings) takes ~11x the bytes of its
# JSON (measured with tracemalloc): the queue budget counts that, not the wire size.
MEMORY_PER_JSON_BYTE = 12


def _cost(raw_len: int, count: int, msg: Any = None) -> int:
    """A queued message's memory: 12x its share of the JSON, or what its type says it
    takes when that is more (many small nested models: a compact rank_stats, 24x)."""
    share = MEMORY_PER_JSON_BYTE * raw_len // max(count, 1)
    own = getattr(msg, "memory_bytes", None)
    return max(share, own()) if callable(own) else share


def _result(fut: Future) -> dict[str, Any]:
    try:
        return fut.result()
    except Exception as e:  # a bug in the writer: reported, never a dropped connection
        return refusal(500, f"the dashboard could not store this message: {e}")


def _grant(writer: Any, scope: dict[str, Any], msgs: list[Any]) -> None:
    """Queued right behind them: the run_starts of a trainer holding the launch token make
    their commands launchable (only theirs, only as sent)."""
    if auth_level(scope) == OWNER:
        signer = scope["app"].state.grants
        for m in msgs:
            if isinstance(m, RunStart):
                writer.submit(grant_job(m, signer))


async def _put_waiting(writer: Any, items: list[Any]) -> None:
    """Websocket back-pressure: wait (without blocking the loop) until the queue has room;
    meanwhile this connection is not read, so TCP slows the trainer's sender thread."""
    while not writer.try_put(items):
        await asyncio.sleep(0.01)


def _must_close(writer: Any) -> tuple[int, str] | None:
    """After a frame: a full disk (507) or a database out of reach (503) closes the ingest
    websocket (1013); the trainer reconnects later and replays from the last stored step."""
    if writer.disk_full:
        return 507, "the dashboard's disk is full"
    if writer.outage.down:
        return 503, "the dashboard's database is unavailable"
    return None


@router.websocket("/ws/ingest")
async def ws_ingest(ws: WebSocket) -> None:
    """Each message gets its reply only when it asks (`ack`, run_start) or is refused: an
    error frame `{"ok": false, "status": 4xx, "error": ...}`, and the connection stays open.
    On a full disk the server closes with 1013 after the error: the trainer reconnects later
    and replays from the last stored step."""
    await ws.accept()
    writer = ws.app.state.writer
    late: deque[dict[str, Any]] = deque()  # refusals of un-acked messages (writer thread)

    def on_done(fut: Future) -> None:
        res = _result(fut)
        if not res.get("ok", True):
            late.append(res)

    async def handle(msg: Any, size: int) -> None:
        if isinstance(msg, MessageError):
            await ws.send_text(json.dumps(refusal(422, str(msg), type="error")))
            return
        fut: Future = Future()
        await _put_waiting(writer, [(msg, fut, size)])
        _grant(writer, ws.scope, [msg])
        if isinstance(msg, RunStart):  # the reply tells the trainer what to replay
            await asyncio.wrap_future(fut)
            await ws.send_text(json.dumps(_result(fut)))
        elif msg.ack is not None:
            await asyncio.wrap_future(fut)
            res = _result(fut)
            await ws.send_text(json.dumps({**res, "type": "ack", "ack": msg.ack}))
        else:
            fut.add_done_callback(on_done)

    try:
        while True:
            data = await ws.receive()
            if data["type"] == "websocket.disconnect":
                return
            raw = data.get("text") if data.get("text") is not None else data.get("bytes") or b""
            msgs = parse_messages(raw)
            for msg in msgs:
                try:
                    await handle(msg, _cost(len(raw), len(msgs), msg))
                except (WebSocketDisconnect, RuntimeError):
                    raise
                except Exception as e:
                    await ws.send_text(json.dumps(refusal(500, f"internal error: {e}")))
            while late:
                await ws.send_text(json.dumps(late.popleft()))
            closing = _must_close(writer)
            if closing is not None:
                status, error = closing
                await ws.send_text(json.dumps(refusal(status, error)))
                await ws.close(1013, "the dashboard cannot store now; reconnect later")
                return
    except (WebSocketDisconnect, RuntimeError):
        return


def _is_json(request: Request) -> bool:
    ctype = request.headers.get("content-type", "")
    return ctype.split(";")[0].strip().lower() == "application/json"


@router.post("/api/ingest", tags=["ingest"])
async def http_ingest(request: Request) -> JSONResponse:
    """The same messages as /ws/ingest, one or a JSON list, for networks that block websockets.

    Only `Content-Type: application/json`: a browser cannot send that cross-site without a
    CORS preflight, which this server never grants.
    """
    if not _is_json(request):
        return JSONResponse({"detail": "ingest takes Content-Type: application/json only"}, 415)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_MESSAGE_BYTES:
        return JSONResponse({"detail": f"body over the {MAX_MESSAGE_BYTES}-byte limit"}, 413)
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MESSAGE_BYTES:
            return JSONResponse({"detail": f"body over the {MAX_MESSAGE_BYTES}-byte limit"}, 413)
    if not body.strip():
        return JSONResponse(
            {"detail": "empty body: send a message or a JSON list of messages"}, 400
        )
    parsed = parse_messages(body)
    errors: list[dict[str, Any]] = []
    items: list[tuple[int, Any, Future]] = []
    for i, m in enumerate(parsed):
        if isinstance(m, MessageError):
            errors.append({"index": i, "status": 422, "error": str(m)})
        else:
            items.append((i, m, Future()))
    if len(parsed) == 1 and isinstance(parsed[0], MessageError) and parsed[0].not_json:
        return JSONResponse({"detail": errors[0]["error"]}, 400)
    writer = request.app.state.writer
    queued = [(m, fut, _cost(len(body), len(parsed), m)) for _, m, fut in items]
    if items and not writer.try_put(queued):
        return JSONResponse(
            {"detail": "the dashboard is busy writing; retry after the Retry-After seconds"},
            503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    _grant(writer, request.scope, [m for _, m, _ in items])
    results: list[Any] = []
    accepted = 0
    for i, _, fut in items:
        await asyncio.wrap_future(fut)
        res = _result(fut)
        if res.get("ok", True):
            accepted += 1
            if res.get("type") == "run_start":
                results.append(res)
        else:
            errors.append({"index": i, "status": res["status"], "error": res["error"]})
    status = max((e["status"] for e in errors), default=200)
    errors.sort(key=lambda e: e["index"])
    # 503: the database is out of reach (outage.py); the trainer's client waits Retry-After
    retry = {"Retry-After": str(OUTAGE_RETRY_S)} if status == 503 else None
    body = {"accepted": accepted, "results": results, "errors": errors}
    return JSONResponse(body, status, headers=retry)


async def _feed(ws: WebSocket, run_id: str | None) -> None:
    await ws.accept()
    hub = ws.app.state.hub
    q = hub.subscribe(run_id)
    try:
        recv = asyncio.ensure_future(ws.receive())
        while True:
            get = asyncio.ensure_future(q.get())
            done, _ = await asyncio.wait({recv, get}, return_when=asyncio.FIRST_COMPLETED)
            if recv in done:
                get.cancel()
                if recv.result()["type"] == "websocket.disconnect":
                    return
                recv = asyncio.ensure_future(ws.receive())
                continue
            await ws.send_text(json.dumps(get.result()))
    except (WebSocketDisconnect, RuntimeError):
        return
    finally:
        hub.unsubscribe(run_id, q)
        with contextlib.suppress(Exception):
            recv.cancel()


@router.websocket("/ws/runs")
async def ws_run_list(ws: WebSocket) -> None:
    await _feed(ws, None)


@router.websocket("/ws/runs/{run_id}")
async def ws_run(ws: WebSocket, run_id: str) -> None:
    await _feed(ws, run_id)
