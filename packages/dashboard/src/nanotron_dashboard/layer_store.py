"""The per-layer statistics table: written from `layer_stats` messages, read as the run page's
layers x steps heatmap.

One row per (run, statistic, detail step): its row names and its values as compact JSON
(null: no value; NaN and +-Infinity kept, since a non-finite gradient is what this view
shows). A replay of a step overwrites it. A heatmap reads one statistic's rows only.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sqlalchemy.engine import Connection

from .fields import INT64_MAX
from .heatmap import fetch, json_body, pick_steps
from .layer_messages import LayerStats

# values in one heatmap response (steps x rows): a few MB of JSON at most
HEATMAP_VALUES = 500_000
_NON_FINITE = re.compile(r"-?Infinity|NaN")  # Python's JSON tokens: strings in a response


def store_layer_stats(conn: Connection, pk: int, m: LayerStats) -> bool:
    rows = json.dumps(m.rows, separators=(",", ":"))
    for stat, values in m.stats.items():
        conn.exec_driver_sql(
            "INSERT INTO layer_stats(run_pk, stat, step, time, n, rows, vals) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(run_pk, stat, step) DO UPDATE SET "
            "time=excluded.time, n=excluded.n, rows=excluded.rows, vals=excluded.vals",
            (
                pk,
                stat,
                m.step,
                m.time,
                len(m.rows),
                rows,
                json.dumps(values, separators=(",", ":")),
            ),
        )
    return True


def layer_stat_names(conn: Connection, pk: int) -> list[str]:
    rows = conn.exec_driver_sql(
        "SELECT DISTINCT stat FROM layer_stats WHERE run_pk=? ORDER BY stat", (pk,)
    )
    return [str(r[0]) for r in rows]


def layer_stats(
    conn: Connection,
    pk: int,
    stat: str | None,
    from_step: int | None,
    to_step: int | None,
    max_steps: int,
    head: dict[str, Any],
) -> bytes:
    """One statistic's rows x steps values (`grad_norm` when stored and `stat` is None, else
    the first), as the response's JSON (after `head`'s keys).

    At most `max_steps` detail steps, evenly spaced and always the newest, fewer when steps x
    the most rows a step of the range has would exceed HEATMAP_VALUES; `total` says how many
    exist. `rows` is every row of the picked steps in first-seen order and `values[j][i]` step
    `steps[j]`'s value of row i (null: none; "NaN", "Infinity": non-finite).
    """
    names = layer_stat_names(conn, pk)
    if stat is None and names:
        stat = "grad_norm" if "grad_norm" in names else names[0]
    out: dict[str, Any] = {**head, "stats": names, "stat": stat, "total": 0}
    out |= {"rows": [], "steps": [], "times": []}
    where = "run_pk=? AND stat=? AND step BETWEEN ? AND ?"
    params = (pk, stat, -1 if from_step is None else from_step)
    params += (INT64_MAX if to_step is None else to_step,)
    total, widest = conn.exec_driver_sql(
        f"SELECT COUNT(*), MAX(n) FROM layer_stats WHERE {where}", params
    ).first()
    out["total"] = total
    if not total:
        return json_body(out, {"values": []})
    k = max(1, min(max_steps, HEATMAP_VALUES // max(int(widest), 1)))
    picked = pick_steps(conn, "layer_stats", where, params, total, k)
    index: dict[str, int] = {}
    steps: list[tuple[list[str], list[Any]]] = []
    cols = "step, time, rows, vals"
    size = "length(rows) + length(vals)"
    for step, t, rows_json, vals_json in fetch(
        conn, "layer_stats", cols, size, where, params, picked
    ):
        rows = json.loads(rows_json)
        for r in rows:
            index.setdefault(r, len(index))
        out["steps"].append(step)
        out["times"].append(t)
        steps.append((rows, vals_json))
    out["rows"] = list(index)
    return json_body(out, {"values": [_aligned(rows, vals, index) for rows, vals in steps]})


def _aligned(rows: list[str], vals_json: str, index: dict[str, int]) -> bytes:
    """A step's values in the response's row order, as JSON (its own order when it has them
    all: the stored text as it is, its non-finite tokens quoted)."""
    if len(rows) == len(index) and all(index[r] == i for i, r in enumerate(rows)):
        return _NON_FINITE.sub(lambda m: f'"{m.group()}"', vals_json).encode()
    values: list[Any] = [None] * len(index)
    for r, v in zip(rows, json.loads(vals_json), strict=True):
        values[index[r]] = v
    text = json.dumps(values, separators=(",", ":"))
    return _NON_FINITE.sub(lambda m: f'"{m.group()}"', text).encode()
