"""The SQL each telemetry message becomes, and the events the dashboard derives itself.

Run inside the writer's transaction. Each function that may store an event returns the
event as the API shows it (or None when it was a replay), so that the writer can hand newly
stored events to the webhook sender and the live feed after the commit.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from sqlalchemy.engine import Connection

from .fields import MAX_RANKS
from .layer_messages import LayerStats
from .layer_store import store_layer_stats
from .moe_messages import MoELoad
from .moe_store import store_moe_load
from .prediction_messages import Prediction
from .prediction_store import store_prediction
from .store import refusal
from .telemetry_messages import (
    LEGACY_RANK_FIELDS,
    MAX_EXTRA_PHASES,
    RANK_FIELDS,
    Event,
    PipelineTimeline,
    RankStats,
    Samples,
)

EventDict = dict[str, Any]


def _nan(v: float | int | None) -> float:
    return math.nan if v is None else float(v)


class Side:
    """What a transaction produced besides metric rows, handed on after its commit."""

    def __init__(self) -> None:
        self.notices: dict[str, list[dict[str, Any]]] = {}  # for the live feed
        self.events: list[EventDict] = []  # newly stored events: webhook and live feed

    def event(self, ev: EventDict | None) -> None:
        if ev is None:  # a replay
            return
        self.events.append(ev)
        notice = {k: ev[k] for k in ("id", "kind", "severity", "step")}
        self.notices.setdefault(ev["run_id"], []).append({"type": "event", **notice})


def _columns(names: list[str], have: list[str], vals: np.ndarray) -> np.ndarray:
    """`vals` (columns `have`) laid out as columns `names`, NaN where a name is missing."""
    out = np.full((len(vals), len(names)), np.nan)
    for j, name in enumerate(have):
        out[:, names.index(name)] = vals[:, j]
    return out


def _interval_too_big(m: RankStats, n: int, names: list[str]) -> dict[str, Any] | None:
    """A stored interval holds at most MAX_RANKS ranks and MAX_EXTRA_PHASES unknown phases,
    whatever messages it was merged from: what a heatmap reads of it stays bounded."""
    extra = len(names) - len(RANK_FIELDS)
    if n <= MAX_RANKS and extra <= MAX_EXTRA_PHASES:
        return None
    return refusal(
        422,
        f"rank_stats step {m.step}: the interval would hold {n} ranks and {extra} unknown "
        f"phases, over the limits of {MAX_RANKS} and {MAX_EXTRA_PHASES}",
    )


def store_rank_stats(conn: Connection, pk: int, m: RankStats) -> bool | dict[str, Any]:
    """Merge the message's ranks into the step's row: a large world arrives as several
    messages per step (disjoint ranks), and a replay overwrites its own ranks only. The row
    names its columns: the known fields, then the phases this release does not know."""
    extra = sorted({k for r in m.ranks for k in r.phases()})
    names = [*RANK_FIELDS, *extra]
    coords = np.array([(r.rank, r.dp, r.tp, r.pp, r.cp) for r in m.ranks], dtype="<i8")
    vals = np.array(
        [[_nan(getattr(r, f)) for f in RANK_FIELDS] + [_nan(r.phases().get(f)) for f in extra]
         for r in m.ranks],
        dtype="<f8",
    )  # fmt: skip
    hosts = [r.host for r in m.ranks]
    old = conn.exec_driver_sql(
        "SELECT n, coords, hosts, vals, fields FROM rank_stats WHERE run_pk=? AND step=?",
        (pk, m.step),
    ).first()
    if old is not None:
        n = old[0]
        have = json.loads(old[4]) if old[4] else list(LEGACY_RANK_FIELDS)
        names += [f for f in have if f not in names]
        old_coords = np.frombuffer(old[1], dtype="<i8").reshape(n, 5)
        old_vals = _columns(names, have, np.frombuffer(old[3], dtype="<f8").reshape(n, len(have)))
        vals = _columns(names, names[: vals.shape[1]], vals)
        keep = ~np.isin(old_coords[:, 0], coords[:, 0])
        old_hosts = json.loads(old[2])
        coords = np.concatenate([old_coords[keep], coords])
        vals = np.concatenate([old_vals[keep], vals])
        hosts = [h for h, k in zip(old_hosts, keep.tolist()) if k] + hosts
        order = np.argsort(coords[:, 0], kind="stable")
        coords, vals, hosts = coords[order], vals[order], [hosts[i] for i in order.tolist()]
    refused = _interval_too_big(m, len(coords), names)
    if refused is not None:
        return refused
    conn.exec_driver_sql(
        "INSERT INTO rank_stats(run_pk, step, time, interval, n, coords, hosts, vals, fields) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(run_pk, step) DO UPDATE SET "
        "time=excluded.time, interval=excluded.interval, n=excluded.n, "
        "coords=excluded.coords, hosts=excluded.hosts, vals=excluded.vals, "
        "fields=excluded.fields",
        (
            pk,
            m.step,
            m.time,
            m.interval,
            len(coords),
            coords.tobytes(),
            json.dumps(hosts),
            np.ascontiguousarray(vals, dtype="<f8").tobytes(),
            json.dumps(names),
        ),
    )
    return True


def store_timeline(conn: Connection, pk: int, m: PipelineTimeline) -> bool:
    """Spans as compact rows [stage, chunk, micro_batch, kind, start_ms, end_ms], the kind
    by its name: the dashboard learns the kinds from the timelines it stores."""
    spans = [[s.stage, s.chunk, s.micro_batch, s.kind, s.start_ms, s.end_ms] for s in m.spans]
    conn.exec_driver_sql(
        "INSERT INTO timelines(run_pk, step, time, schedule, pp, chunks, "
        "micro_batches, bubble_measured, bubble_formula, n_spans, spans, clock) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(run_pk, step) DO UPDATE SET "
        "time=excluded.time, schedule=excluded.schedule, pp=excluded.pp, "
        "chunks=excluded.chunks, micro_batches=excluded.micro_batches, "
        "bubble_measured=excluded.bubble_measured, bubble_formula=excluded.bubble_formula, "
        "n_spans=excluded.n_spans, spans=excluded.spans, clock=excluded.clock",
        (
            pk,
            m.step,
            m.time,
            m.schedule,
            m.pp,
            m.chunks,
            m.micro_batches,
            m.bubble_measured,
            m.bubble_formula,
            len(spans),
            json.dumps(spans, separators=(",", ":")),
            m.clock.model_dump_json(),
        ),
    )
    return True


def store_samples(conn: Connection, pk: int, m: Samples) -> bool:
    """False for a replay of the same (run, step): it is ignored."""
    cur = conn.exec_driver_sql(
        "INSERT INTO samples(run_pk, step, time, max_new_tokens, samples) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT(run_pk, step) DO NOTHING",
        (
            pk,
            m.step,
            m.time,
            m.max_new_tokens,
            json.dumps([s.model_dump() for s in m.samples]),
        ),
    )
    return cur.rowcount == 1


# The telemetry messages stored per step, each by its function: True when something new was
# stored (the live feed then tells the pages), a refusal (a dict) when it may not be.
# Events are stored by store_trainer_event.
Store = Callable[[Connection, int, Any], bool | dict[str, Any]]
STORE: dict[type, Store] = {
    RankStats: store_rank_stats,
    PipelineTimeline: store_timeline,
    Samples: store_samples,
    MoELoad: store_moe_load,
    LayerStats: store_layer_stats,
    Prediction: store_prediction,
}


def store_event(
    conn: Connection,
    pk: int,
    run_id: str,
    *,
    kind: str,
    severity: str,
    message: str,
    step: int | None,
    time_s: float,
    details: dict[str, Any],
    source: str,
) -> EventDict | None:
    """Store one event; None when the same (run, kind, step, message) is already stored."""
    row = conn.exec_driver_sql(
        "INSERT INTO events(run_pk, step, time, kind, severity, message, details, "
        "source) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING id",
        (pk, step, time_s, kind, severity, message, json.dumps(details, default=str), source),
    ).first()
    if row is None:
        return None
    return {
        "id": int(row[0]),
        "run_id": run_id,
        "step": step,
        "time": time_s,
        "kind": kind,
        "severity": severity,
        "message": message,
        "details": details,
        "source": source,
    }


def store_trainer_event(conn: Connection, pk: int, m: Event) -> EventDict | None:
    return store_event(
        conn,
        pk,
        m.run_id,
        kind=m.kind,
        severity=m.severity,
        message=m.message,
        step=m.step,
        time_s=m.time if m.time is not None else time.time(),
        details=m.details,
        source="trainer",
    )


def restart_event(
    conn: Connection, pk: int, run_id: str, attempt: str, step: int | None, t: float
) -> EventDict | None:
    """A run_start with a new `attempt` for a run that already existed: a restart."""
    n = conn.exec_driver_sql("SELECT COUNT(*) FROM run_attempts WHERE run_pk=?", (pk,)).scalar()
    where = "from the start" if step is None else f"after step {step}"
    return store_event(
        conn,
        pk,
        run_id,
        kind="restart",
        severity="warning",
        message=f"run restarted (launch {n}) {where}",
        step=step,
        time_s=t,
        details={"attempt": attempt, "launches": n, "last_step": step},
        source="dashboard",
    )


class StallCheck:
    """A writer job: a `stall` event for each running run silent for `after_s` seconds.

    Once per silence: run_stall keeps the heartbeat each event was derived from, so the
    same silence is not reported again, and a new message followed by a new silence is.
    Silence is counted from this server's start at the earliest: while the dashboard was
    down the trainers could not reach it, which is not theirs to answer for.
    """

    def __init__(self, after_s: float, started: float | None = None) -> None:
        self.after_s = after_s
        self.started = time.time() if started is None else started

    def __call__(self, conn: Connection, now: float) -> list[EventDict]:
        if now - self.started < self.after_s:
            return []
        rows = conn.exec_driver_sql(
            "SELECT r.pk, r.id, r.step, r.heartbeat FROM runs r WHERE r.status='running' "
            "AND r.heartbeat IS NOT NULL AND r.heartbeat < ? AND NOT EXISTS (SELECT 1 FROM "
            "run_stall s WHERE s.run_pk=r.pk AND s.heartbeat=r.heartbeat)",
            (now - self.after_s,),
        ).fetchall()
        out = []
        for pk, run_id, step, heartbeat in rows:
            conn.exec_driver_sql(
                "INSERT INTO run_stall(run_pk, heartbeat) VALUES (?, ?) "
                "ON CONFLICT(run_pk) DO UPDATE SET heartbeat=excluded.heartbeat",
                (pk, heartbeat),
            )
            last = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(heartbeat))
            at = "" if step is None else f", step {step}"
            ev = store_event(
                conn,
                pk,
                run_id,
                kind="stall",
                severity="critical",
                message=f"no message from the trainer for {self.after_s:g} s (last at {last}{at})",
                step=step,
                time_s=now,
                details={"silent_since": heartbeat, "stall_after_s": self.after_s},
                source="dashboard",
            )
            if ev is not None:
                out.append(ev)
        return out


def set_labels(conn: Connection, pk: int, tags: list[str] | None, note: str | None) -> dict:
    """Replace the tags and/or the note (None leaves that one as it is)."""
    row = conn.exec_driver_sql("SELECT tags, note FROM run_labels WHERE run_pk=?", (pk,)).first()
    cur_tags, cur_note = (json.loads(row[0]), row[1]) if row else ([], "")
    new_tags = cur_tags if tags is None else tags
    new_note = cur_note if note is None else note
    conn.exec_driver_sql(
        "INSERT INTO run_labels(run_pk, tags, note) VALUES (?, ?, ?) "
        "ON CONFLICT(run_pk) DO UPDATE SET tags=excluded.tags, note=excluded.note",
        (pk, json.dumps(new_tags), new_note),
    )
    return {"tags": new_tags, "note": new_note}
