"""The expert load table: written from `moe_load` messages, read as the run page's heatmap.

One row per (run, layer, logged step), its counts a packed little-endian int64 array, so a
heatmap of 400 steps reads 400 small blobs. A replay of a step overwrites it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from sqlalchemy.engine import Connection

from .fields import INT64_MAX
from .heatmap import fetch, json_body, pick_steps
from .moe_messages import MoELoad

# counts in one heatmap response (steps x experts): a few MB of JSON at most
HEATMAP_COUNTS = 500_000


def store_moe_load(conn: Connection, pk: int, m: MoELoad) -> bool:
    for x in m.layers:
        conn.exec_driver_sql(
            "INSERT INTO moe_load(run_pk, layer, step, time, n, counts) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(run_pk, layer, step) DO UPDATE SET time=excluded.time, n=excluded.n, "
            "counts=excluded.counts",
            (pk, x.layer, m.step, m.time, len(x.counts), np.array(x.counts, "<i8").tobytes()),
        )
    return True


def moe_layers(conn: Connection, pk: int) -> list[int]:
    rows = conn.exec_driver_sql(
        "SELECT DISTINCT layer FROM moe_load WHERE run_pk=? ORDER BY layer", (pk,)
    )
    return [int(r[0]) for r in rows]


def moe_load(
    conn: Connection,
    pk: int,
    layer: int | None,
    from_step: int | None,
    to_step: int | None,
    max_steps: int,
    head: dict[str, Any],
) -> bytes:
    """One layer's expert x step counts (the first layer when `layer` is None), as the
    response's JSON (after `head`'s keys).

    At most `max_steps` logged steps, evenly spaced and always the newest, fewer when steps x
    the most experts a step of the range has would exceed HEATMAP_COUNTS; `total` says how
    many exist. `counts[j]` is step `steps[j]`'s count per expert, `tokens[j]` their sum
    (tokens x top_k assignments), both exact integers.
    """
    layers = moe_layers(conn, pk)
    if layer is None and layers:
        layer = layers[0]
    out: dict[str, Any] = {**head, "layers": layers, "layer": layer, "num_experts": 0}
    out |= {"total": 0, "steps": [], "times": [], "tokens": []}
    where = "run_pk=? AND layer=? AND step BETWEEN ? AND ?"
    params = (pk, layer, -1 if from_step is None else from_step)
    params += (INT64_MAX if to_step is None else to_step,)
    total, widest = conn.exec_driver_sql(
        f"SELECT COUNT(*), MAX(n) FROM moe_load WHERE {where}", params
    ).first()
    out["total"] = total
    if not total:
        return json_body(out, {"counts": []})
    # bounded by the widest step, not the newest: older steps may count more experts
    k = max(1, min(max_steps, HEATMAP_COUNTS // max(int(widest), 1)))
    picked = pick_steps(conn, "moe_load", where, params, total, k)
    counts: list[bytes] = []
    for step, t, blob in fetch(
        conn, "moe_load", "step, time, counts", "length(counts)", where, params, picked
    ):
        row = np.frombuffer(blob, dtype="<i8").tolist()
        out["steps"].append(step)
        out["times"].append(t)
        out["tokens"].append(sum(row))  # a Python int: exact, where an int64 sum would wrap
        counts.append(json.dumps(row, separators=(",", ":")).encode())
        out["num_experts"] = len(row)
    return json_body(out, {"counts": counts})
