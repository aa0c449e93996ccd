"""The bounded read behind the heatmaps (rank stats, expert load): which stored steps, fetched
in batches of bounded bytes, encoded to JSON without a Python object per number, and at most
HEAVY_READS of them built at once.

A heatmap response may hold a million numbers (~25 MB of JSON). What it costs the server is
then the response, not the run: the steps are picked in SQL (never a list of every stored
step), rows come in batches of at most READ_BATCH_BYTES, and each row is encoded as soon as it
is read. Two such responses at once fit the memory budget (docs/security.md); a third waits
for one of them, or is told to retry.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from fastapi import HTTPException
from sqlalchemy.engine import Connection

from .backend import qmarks

READ_BATCH_BYTES = 8 << 20  # stored rows read at once
HEAVY_READS = 2  # heatmap responses built at once
HEAVY_WAIT_S = 10.0  # then 503 + Retry-After
_gate = threading.BoundedSemaphore(HEAVY_READS)


@contextmanager
def heavy_read() -> Iterator[None]:
    """Hold one of the HEAVY_READS slots while a heatmap is built (the routes run on a thread
    pool of 40: without this, 40 responses of 25 MB could be in the making at once)."""
    if not _gate.acquire(timeout=HEAVY_WAIT_S):
        raise HTTPException(
            503, "the dashboard is building other heatmaps; retry", headers={"Retry-After": "1"}
        )
    try:
        yield
    finally:
        _gate.release()


def evenly(total: int, k: int) -> list[int]:
    """At most k indices evenly spaced over 0 .. total-1, the last (the newest) always."""
    if total <= 0 or k <= 0:
        return []
    if k == 1:
        return [total - 1]
    return sorted({int(round(i)) for i in np.linspace(0, total - 1, min(k, total))})


def pick_steps(
    conn: Connection, table: str, where: str, params: Sequence[Any], total: int, k: int
) -> list[int]:
    """The steps at `evenly(total, k)` positions among the rows `where` selects, by step order,
    numbered in SQL: a run's millionth stored step costs the server nothing here."""
    idx = evenly(total, k)
    rows = conn.exec_driver_sql(
        f"SELECT step FROM (SELECT step, ROW_NUMBER() OVER (ORDER BY step) - 1 AS i FROM {table} "
        f"WHERE {where}) AS t WHERE i IN {qmarks(len(idx))} ORDER BY step",
        (*params, *idx),
    )
    return [int(r[0]) for r in rows]


def fetch(
    conn: Connection,
    table: str,
    columns: str,
    size: str,
    where: str,
    params: Sequence[Any],
    steps: list[int],
) -> Iterator[tuple]:
    """The rows of `steps` (in step order), `columns` of each, read in batches whose `size`
    (an SQL expression of a row's bytes) sums to at most READ_BATCH_BYTES (one larger row
    alone)."""
    sizes = dict(
        conn.exec_driver_sql(
            f"SELECT step, {size} FROM {table} WHERE {where} AND step IN {qmarks(len(steps))}",
            (*params, *steps),
        ).fetchall()
    )
    batch: list[int] = []
    held = 0
    for step in [*steps, None]:
        nbytes = int(sizes.get(step) or 0) if step is not None else 0
        if batch and (step is None or held + nbytes > READ_BATCH_BYTES):
            yield from conn.exec_driver_sql(
                f"SELECT {columns} FROM {table} WHERE {where} AND step IN {qmarks(len(batch))} "
                "ORDER BY step",
                (*params, *batch),
            )
            batch, held = [], 0
        if step is not None:
            batch.append(step)
            held += nbytes


def floats_json(a: np.ndarray) -> bytes:
    """A float array as a JSON list, NaN as null, at full precision (Python's repr)."""
    return json.dumps(a.tolist(), separators=(",", ":")).replace("NaN", "null").encode()


Raw = bytes | list["Raw"] | dict[str, "Raw"]  # JSON already encoded, or lists/objects of it


def _pieces(value: Raw, out: list[bytes]) -> None:
    if isinstance(value, bytes):
        out.append(value)
        return
    items = value.items() if isinstance(value, dict) else enumerate(value)
    out.append(b"{" if isinstance(value, dict) else b"[")
    for i, (key, v) in enumerate(items):
        out.append(b"," if i else b"")
        if isinstance(value, dict):
            out.append(json.dumps(key).encode() + b":")
        _pieces(v, out)
    out.append(b"}" if isinstance(value, dict) else b"]")


def json_body(head: dict[str, Any], raw: dict[str, Raw]) -> bytes:
    """`head` as a JSON object with `raw`'s keys added as already-encoded JSON. The pieces
    are joined once, into the response."""
    out = [json.dumps(head, allow_nan=False, separators=(",", ":"))[:-1].encode()]
    for key, value in raw.items():
        out.append(("," if head else "").encode() + json.dumps(key).encode() + b":")
        _pieces(value, out)
        head = head or {"": None}  # a key was written: the next one needs its comma
    out.append(b"}")
    return b"".join(out)
