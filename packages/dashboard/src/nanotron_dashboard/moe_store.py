"""The expert load table: written from `moe_load` messages, read as the run page's heatmap.

One row per (run, layer, logged step), its counts a packed little-endian int64 array, so a
heatmap of 400 steps reads 400 small blobs. A replay of a step overwrites it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy.engine import Connection

from .backend import qmarks
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
) -> dict[str, Any]:
    """One layer's expert x step counts (the first layer when `layer` is None).

    At most `max_steps` logged steps, evenly spaced and always the newest, fewer when steps x
    experts would exceed HEATMAP_COUNTS; `total` says how many exist. `counts[j]` is step
    `steps[j]`'s count per expert, `tokens[j]` their sum (tokens x top_k assignments).
    """
    layers = moe_layers(conn, pk)
    if layer is None and layers:
        layer = layers[0]
    out: dict[str, Any] = {"layers": layers, "layer": layer, "num_experts": 0, "total": 0}
    out |= {"steps": [], "times": [], "counts": [], "tokens": []}
    lo = -1 if from_step is None else from_step
    hi = 2**63 - 1 if to_step is None else to_step
    steps = [
        r[0]
        for r in conn.exec_driver_sql(
            "SELECT step FROM moe_load WHERE run_pk=? AND layer=? AND step BETWEEN ? AND ? "
            "ORDER BY step",
            (pk, layer, lo, hi),
        )
    ]
    out["total"] = len(steps)
    if not steps:
        return out
    newest = conn.exec_driver_sql(
        "SELECT n FROM moe_load WHERE run_pk=? AND layer=? AND step=?", (pk, layer, steps[-1])
    ).scalar()
    k = max(1, min(max_steps, HEATMAP_COUNTS // max(int(newest), 1), len(steps)))
    picked = sorted({steps[int(round(i))] for i in np.linspace(0, len(steps) - 1, k)})
    for step, t, counts in conn.exec_driver_sql(
        f"SELECT step, time, counts FROM moe_load WHERE run_pk=? AND layer=? AND step IN "
        f"{qmarks(len(picked))} ORDER BY step",
        (pk, layer, *picked),
    ):
        row = np.frombuffer(counts, dtype="<i8")
        out["steps"].append(step)
        out["times"].append(t)
        out["counts"].append(row.tolist())
        out["tokens"].append(int(row.sum()))
    out["num_experts"] = len(out["counts"][-1])
    return out
