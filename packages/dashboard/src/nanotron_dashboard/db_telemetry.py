"""The telemetry tables: per-rank stats, pipeline timelines, events, samples, labels, stall
marks, expert load and per-layer statistics, on db.py's metadata (db_meta.py). New tables, so create_all adds them
to older files; a column added to one of them is a migration (migrations.py)."""

from __future__ import annotations

from sqlalchemy import (
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    func,
)

from .db_meta import Int64, metadata

# The tables keyed by run_pk: a deleted run's rows go with it (db.delete_run).
TELEMETRY_TABLES = (
    "rank_stats", "timelines", "events", "samples", "run_labels", "run_stall", "moe_load",
    "layer_stats", "predictions",
)  # fmt: skip


# One row per (run, rank_stats step); a replay overwrites. Packed little-endian arrays, so a
# heatmap of 200 intervals x 4,096 ranks reads 200 rows and no JSON.
rank_stats = Table(
    "rank_stats",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("step", Int64, primary_key=True),
    Column("time", Float, nullable=False),
    Column("interval", Int64, nullable=False),
    Column("n", Integer, nullable=False),  # entries (ranks)
    Column("coords", LargeBinary, nullable=False),  # int64 (rank, dp, tp, pp, cp) per entry
    Column("hosts", Text, nullable=False),  # JSON list, one per entry
    Column("vals", LargeBinary, nullable=False),  # float64 n x len(fields), NaN = null
    Column("fields", Text),  # JSON list of the vals' column names; NULL: LEGACY_RANK_FIELDS
    sqlite_with_rowid=False,
)

# One row per (run, MoE layer, logged step): tokens routed to each expert (moe_store.py).
moe_load = Table(
    "moe_load",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("layer", Integer, primary_key=True),
    Column("step", Int64, primary_key=True),
    Column("time", Float, nullable=False),
    Column("n", Integer, nullable=False),  # experts
    Column("counts", LargeBinary, nullable=False),  # int64 little-endian, one per expert
    sqlite_with_rowid=False,
)

# One row per (run, statistic, detail step): per-layer statistics (layer_store.py).
layer_stats = Table(
    "layer_stats",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("stat", String, primary_key=True),
    Column("step", Int64, primary_key=True),
    Column("time", Float, nullable=False),
    Column("n", Integer, nullable=False),  # rows
    Column("rows", Text, nullable=False),  # JSON list of the row names
    Column("vals", Text, nullable=False),  # JSON list, one value (or null, NaN) per row
    sqlite_with_rowid=False,
)

# One row per run: the layout planner's prediction for it (prediction_store.py), as the
# validated message's JSON; a later attempt's replaces it.
predictions = Table(
    "predictions",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("time", Float, nullable=False),
    Column("body", Text, nullable=False),
    sqlite_with_rowid=False,
)

# One row per recorded step; spans as compact JSON rows [stage, chunk, mb, kind, start, end].
timelines = Table(
    "timelines",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("step", Int64, primary_key=True),
    Column("time", Float, nullable=False),
    Column("schedule", String, nullable=False),
    Column("pp", Integer, nullable=False),
    Column("chunks", Integer, nullable=False),
    Column("micro_batches", Integer, nullable=False),
    Column("bubble_measured", Float),
    Column("bubble_formula", Float),
    Column("n_spans", Integer, nullable=False),
    Column("spans", Text, nullable=False),
    # JSON: the rank clocks' alignment (offsets and uncertainty, ms) and the send/receive
    # order violations found; a timeline that violates the order has no measured bubble
    Column("clock", Text, nullable=False, server_default="{}"),
    sqlite_with_rowid=False,
)

# Events from the trainer and those the dashboard derives (restart, stall): source says which.
events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_pk", Integer, nullable=False),
    Column("step", Int64),
    Column("time", Float, nullable=False),
    Column("kind", String, nullable=False),
    Column("severity", String, nullable=False),
    Column("message", Text, nullable=False),
    Column("details", Text, nullable=False, default="{}"),
    Column("source", String, nullable=False, default="trainer"),
)
# a replay of (run, kind, step, message) is stored once; a NULL step counts as one value
Index(
    "uq_events_replay",
    events.c.run_pk,
    events.c.kind,
    func.coalesce(events.c.step, -1),
    events.c.message,
    unique=True,
)

samples = Table(
    "samples",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("step", Int64, primary_key=True),  # stored once per (run, step)
    Column("time", Float, nullable=False),
    Column("max_new_tokens", Integer),
    Column("samples", Text, nullable=False),  # JSON list of {prompt, completion}
    sqlite_with_rowid=False,
)

# Tags and a note, edited in the page (PATCH /api/runs/{id}).
run_labels = Table(
    "run_labels",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("tags", Text, nullable=False, default="[]"),  # JSON list
    Column("note", Text, nullable=False, default=""),
)

# The heartbeat at which a stall event was derived: one event per silence.
run_stall = Table(
    "run_stall",
    metadata,
    Column("run_pk", Integer, primary_key=True),
    Column("heartbeat", Float, nullable=False),
)
