"""Ingest over /ws/ingest and POST /api/ingest, and the browsers' live feeds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
from concurrent.futures import Future
from typing import Any

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from .messages import MAX_MESSAGE_BYTES, MessageError, RunStart, parse_messages

router = APIRouter()


async def _enqueue(app: Any, msg: Any, want: bool) -> Future | None:
    """Queue for the writer in arrival order; waits (without blocking the loop) when full."""
    fut: Future | None = Future() if want else None
    while True:
        try:
            app.state.writer.queue.put_nowait((msg, fut))
            return fut
        except queue.Full:
            await asyncio.sleep(0.005)


@router.websocket("/ws/ingest")
async def ws_ingest(ws: WebSocket) -> None:
    await ws.accept()
    app = ws.app
    try:
        while True:
            data = await ws.receive()
            if data["type"] == "websocket.disconnect":
                return
            raw = data.get("text") if data.get("text") is not None else data.get("bytes") or b""
            for msg in parse_messages(raw):
                if isinstance(msg, MessageError):  # reply and drop it; the connection lives on
                    await ws.send_text(json.dumps({"ok": False, "error": str(msg)}))
                elif isinstance(msg, RunStart):  # the reply tells the trainer what to replay
                    fut = await _enqueue(app, msg, True)
                    await ws.send_text(json.dumps(await asyncio.wrap_future(fut)))
                elif msg.ack is not None:
                    await asyncio.wrap_future(await _enqueue(app, msg, True))
                    await ws.send_text(json.dumps({"ok": True, "type": "ack", "ack": msg.ack}))
                else:
                    await _enqueue(app, msg, False)
    except WebSocketDisconnect:
        return


@router.post("/api/ingest", tags=["ingest"])
async def http_ingest(request: Request) -> JSONResponse:
    """The same messages as /ws/ingest, one or a JSON list, for networks that block websockets."""
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
    msgs, errors = [], []
    for i, m in enumerate(parse_messages(body)):
        if isinstance(m, MessageError):
            errors.append({"index": i, "error": str(m)})
        else:
            msgs.append(m)
    if len(errors) == 1 and not msgs and "JSON" in errors[0]["error"]:  # not JSON at all
        return JSONResponse({"detail": errors[0]["error"]}, 400)
    results: list[Any] = []
    pending: list[Any] = []
    for j, msg in enumerate(msgs):
        # the writer keeps order: waiting for run_starts and the last message is enough
        want = isinstance(msg, RunStart) or j == len(msgs) - 1
        fut = await _enqueue(request.app, msg, want)
        if fut is not None:
            pending.append(asyncio.wrap_future(fut))
    for fut in pending:
        res = await fut
        if res.get("type") == "run_start":
            results.append(res)
    status = 422 if errors else 200
    return JSONResponse({"accepted": len(msgs), "results": results, "errors": errors}, status)


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
