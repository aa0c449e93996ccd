"""The pipeline timeline of one step, gathered on rank 0, with its bubble against the formula.

Every `logging.pipeline_timeline_interval` steps (pp > 1) the trainer aligns all ranks with a
barrier, runs the step with a `TimelineRecorder` (nanotron_parallel/pipeline/recorder.py) and
then gathers the spans of one replica (dp = tp = cp = 0: one rank per stage) to rank 0.

A timeline whose spans violate the send/receive order (a stage computing a micro-batch before
it was sent to it: rank clocks that disagree) is flagged and gets no measured bubble.

bubble_measured: per stage, 1 - (sum of its span durations) / (the step's span, from the common
start to the last span's end on any stage), averaged over stages. bubble_formula: the idle share
planned by the step's engine with equal costs (`PipelineEngine.planned_idle`): (pp - 1) /
(v * m + pp - 1) with v chunks per rank and m micro-batches for afab, 1f1b and interleaved;
(pp - 1) / (3m + pp - 1) for zb-h1 (B and W one slot each); (pp - 1) / (6m + pp - 1) for zbv.
"""

from __future__ import annotations

import torch.distributed as dist

from nanotron_parallel.pipeline import engine as pipeline_engine


def bubble_formula(pp: int, v: int, m: int, engine: str = "1f1b") -> float:
    return pipeline_engine(engine).planned_idle(pp, m, v)


def bubble_measured(spans: list[dict], pp: int) -> float:
    end = max((s["end_ms"] for s in spans), default=0.0)
    if end <= 0:
        return 0.0
    idle = []
    for stage in range(pp):
        busy = sum(s["end_ms"] - s["start_ms"] for s in spans if s["stage"] == stage)
        idle.append(min(1.0, max(0.0, 1.0 - busy / end)))
    return sum(idle) / pp


def order_violations(spans: list[dict], pp: int, engine: str = "1f1b") -> int:
    """Spans that start before what they receive was sent: stage s's forward of a micro-batch
    (virtual stage chunk * pp + s) before the previous virtual stage's forward of it ended,
    or its backward before the next one's backward ended. Rank clocks that started at
    different moments produce such a timeline; its bubble would be a number about nothing."""
    stage_of = pipeline_engine(engine).stage_of  # zbv: the V, W spans receive nothing
    end: dict[tuple[str, int, int], float] = {}
    for s in spans:
        if s["kind"] in ("forward", "backward"):
            end[(s["kind"], stage_of(s["stage"], s["chunk"], pp), s["micro_batch"])] = s["end_ms"]
    bad = 0
    for s in spans:
        vs = stage_of(s["stage"], s["chunk"], pp)
        if s["kind"] == "forward":
            before = end.get(("forward", vs - 1, s["micro_batch"]))
        elif s["kind"] == "backward":
            before = end.get(("backward", vs + 1, s["micro_batch"]))
        else:
            continue
        bad += before is not None and s["start_ms"] < before
    return bad


def gather_spans(spans: list[dict] | None, pc) -> list[dict] | None:
    """Rank 0: every stage's spans (from dp = tp = cp = 0), each with its `stage`; others:
    None."""
    first = pc.dp_rank == 0 and pc.tp_rank == 0 and getattr(pc, "cp_rank", 0) == 0
    mine = spans if first else None
    got: list | None = [None] * pc.world_size if pc.rank == 0 else None
    dist.gather_object((pc.pp_rank, mine), got, dst=0, group=pc.world_group)
    if got is None:
        return None
    out = []
    for stage, stage_spans in got:
        for s in stage_spans or []:
            out.append({"stage": stage, **s})
    out.sort(key=lambda s: (s["stage"], s["start_ms"]))
    return out


def timeline_message(
    step: int, time_s: float, engine: str, pp: int, v: int, m: int, spans: list[dict]
) -> dict:
    """The message; a timeline that violates the send/receive order gets no measured bubble
    and says how many spans violate it (`clock.order_violations`)."""
    bad = order_violations(spans, pp, engine)
    return {
        "type": "pipeline_timeline",
        "step": step,
        "time": time_s,
        "schedule": engine,
        "pp": pp,
        "chunks": v,
        "micro_batches": m,
        "bubble_measured": None if bad else bubble_measured(spans, pp),
        "clock": {"order_violations": bad},
        "bubble_formula": bubble_formula(pp, v, m, engine),
        "spans": [
            {
                "stage": s["stage"],
                "chunk": s["chunk"],
                "micro_batch": s["micro_batch"],
                "kind": s["kind"],
                "start_ms": max(0.0, s["start_ms"]),
                "end_ms": max(0.0, s["end_ms"]),
            }
            for s in spans
        ],
    }
