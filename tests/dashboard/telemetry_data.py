"""Synthetic issue-19 messages (what the trainer sends per PROTOCOL: rank_stats,
pipeline_timeline, event, samples) for the API, webhook and browser tests."""

from __future__ import annotations

from typing import Any

HOSTS = ("node-a", "node-b")


def rank_stats(
    run_id: str, step: int, n: int = 4, slow: int | None = None, factor: float = 2.0
) -> dict[str, Any]:
    """n ranks in a (dp=n/2, tp=2) grid on two hosts; rank `slow` computes `factor` x longer.
    Values depend on rank and step so that a test can tell every cell apart."""
    ranks = []
    for r in range(n):
        compute = 100.0 + r + step / 1000
        if r == slow:
            compute *= factor
        ranks.append(
            {
                "rank": r,
                "host": HOSTS[r * len(HOSTS) // n],
                "dp": r // 2,
                "tp": r % 2,
                "pp": 0,
                "cp": 0,
                "step_ms": 400.0 + step,  # synchronous: the same on every rank
                "compute_ms": compute,
                "tp_comm_ms": 10.0 + r,
                "pp_wait_ms": 0.0,
                "dp_wait_ms": 300.0 - compute,
                "optimizer_ms": 20.0,
                "data_ms": 5.0,
                "mem_bytes": 1_000_000 * (r + 1),
                "mem_reserved_bytes": None,
                "gpu_util_pct": None,
                "gpu_power_w": None,
                "cpu_util_pct": 50.0 + r,
            }
        )
    return {
        "type": "rank_stats",
        "run_id": run_id,
        "step": step,
        "time": 1_764_554_400.0 + step,
        "interval": 10,
        "ranks": ranks,
    }


def one_f_one_b(pp: int, m: int, f_ms: float = 10.0, b_ms: float = 20.0) -> list[dict]:
    """Spans of a 1F1B step with equal stage times, as an ideal clock would see them."""
    spans = []
    free = [0.0] * pp  # when each stage is next idle
    fwd_done: dict[tuple[int, int], float] = {}
    bwd_done: dict[tuple[int, int], float] = {}
    order = []
    for s in range(pp):  # per stage: warm-up forwards, then alternate, then cool-down
        warm = min(pp - s - 1, m)
        seq = [("forward", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                seq.append(("forward", f))
                f += 1
            seq.append(("backward", b))
            b += 1
        order.append(seq)
    pos = [0] * pp
    while any(pos[s] < len(order[s]) for s in range(pp)):
        for s in range(pp):
            if pos[s] >= len(order[s]):
                continue
            kind, mb = order[s][pos[s]]
            if kind == "forward":
                ready = 0.0 if s == 0 else fwd_done.get((s - 1, mb))
            else:
                ready = fwd_done.get((s, mb)) if s == pp - 1 else bwd_done.get((s + 1, mb))
            if ready is None:
                continue
            start = max(free[s], ready)
            end = start + (f_ms if kind == "forward" else b_ms)
            (fwd_done if kind == "forward" else bwd_done)[(s, mb)] = end
            free[s] = end
            spans.append(
                {"stage": s, "chunk": 0, "micro_batch": mb, "kind": kind,
                 "start_ms": start, "end_ms": end}
            )  # fmt: skip
            pos[s] += 1
    return spans


def with_weight_grad(spans: list[dict]) -> list[dict]:
    """Each backward split in two, as a zero-bubble schedule records it: the input gradient
    ("backward", the first half) and then the weight gradient ("W", the second half)."""
    out = []
    for s in spans:
        if s["kind"] != "backward":
            out.append(s)
            continue
        mid = (s["start_ms"] + s["end_ms"]) / 2
        out += [{**s, "end_ms": mid}, {**s, "kind": "W", "start_ms": mid}]
    return out


def timeline(run_id: str, step: int, pp: int = 2, m: int = 4) -> dict[str, Any]:
    spans = one_f_one_b(pp, m)
    total = max(s["end_ms"] for s in spans)
    busy = [sum(s["end_ms"] - s["start_ms"] for s in spans if s["stage"] == k) for k in range(pp)]
    return {
        "type": "pipeline_timeline",
        "run_id": run_id,
        "step": step,
        "time": 1_764_554_400.0 + step,
        "schedule": "1f1b",
        "pp": pp,
        "chunks": 1,
        "micro_batches": m,
        "bubble_measured": sum(1 - b / total for b in busy) / pp,
        "bubble_formula": (pp - 1) / (m + pp - 1),
        "spans": spans,
    }


def event(run_id: str, kind: str, step: int | None, **kw: Any) -> dict[str, Any]:
    msg = {
        "type": "event",
        "run_id": run_id,
        "step": step,
        "time": 1_764_554_400.0 + (step or 0),
        "kind": kind,
        "severity": "warning",
        "message": f"{kind} at step {step}",
        "details": {},
    }
    msg.update(kw)
    return msg


def straggler(run_id: str, step: int, rank: int = 3, host: str = "node-b") -> dict[str, Any]:
    return event(
        run_id,
        "straggler",
        step,
        message=f"rank {rank} (dp={rank // 2} tp={rank % 2} pp=0, host {host}) compute 2.0x "
        "the median for 3 intervals",
        details={"rank": rank, "dp": rank // 2, "tp": rank % 2, "pp": 0, "cp": 0, "host": host,
                 "ratio": 2.0},
    )  # fmt: skip


def samples(run_id: str, step: int, texts: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "type": "samples",
        "run_id": run_id,
        "step": step,
        "time": 1_764_554_400.0 + step,
        "max_new_tokens": 32,
        "samples": [{"prompt": p, "completion": c} for p, c in texts],
    }


# The layout planner's prediction of a run (the `prediction` message): against rank_stats(...,
# n=4, slow=3) at steps 10..100 the step (460 ms measured) and communication are off by more
# than 20%, memory, compute and the optimizer within it, pipeline idle negligible.
PREDICTION = {
    "type": "prediction", "run_id": "pv", "device": "h100", "device_source": "vendor sheet",
    "memory_bytes": 3_900_000, "step_ms": 300.0, "compute_ms": 120.0, "comm_ms": 100.0,
    "idle_ms": 0.0, "optimizer_ms": 21.0, "tokens_per_s_per_device": 5000.0, "mfu": 0.4,
}  # fmt: skip
