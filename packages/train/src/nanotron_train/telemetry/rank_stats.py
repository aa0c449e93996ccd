"""Per-rank statistics of an interval: one fixed-size float64 row per rank, gathered once.

Every `logging.rank_stats_interval` steps each rank turns its PhaseTimer totals (summed over
the interval's steps) into means and adds its peak memory and utilisation; one
`all_gather_into_tensor` of a [FIELDS] row per rank brings the [world, FIELDS] table to every
rank (the only collective of the interval). Who is where (host and dp/tp/pp/cp coordinates)
is gathered once at start. Rank 0 turns the table into `rank_stats` messages.

compute = the pipeline's forwards and backwards minus the communication inside them (the tp
collectives, expert parallel's dispatch and combine `all_to_all`, the pp transfers and ZeRO-3's
parameter gathers); `dp_wait` is the wait for the gradient reduction (and
the tied-embedding sum) after the last backward plus those ZeRO-3 gathers and the collectives
of the optimizer phase (`optimizer_comm`: the grad-norm all-reduce and the ZeRO-1/2 parameter
all-gather, where the ranks that arrive first wait for the slowest); `optimizer` is the rest
of that phase (the norm's local part, clipping, the optimizer step); `data` the host time to
get the micro-batches onto the device. `step` is the wall
time of the whole step: the shares need not add up to it (bookkeeping, the loss read of a
logged step).
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanotron_train.reporting.device_peaks import peak_memory_bytes

FIELDS = (
    "step_ms",
    "compute_ms",
    "tp_comm_ms",
    "all_to_all_ms",
    "pp_wait_ms",
    "dp_wait_ms",
    "optimizer_ms",
    "data_ms",
    "mem_bytes",
    "mem_reserved_bytes",
    "gpu_util_pct",
    "gpu_power_w",
    "cpu_util_pct",
)
INT_FIELDS = {"mem_bytes", "mem_reserved_bytes"}
# Newer torch names the tensor-in/tensor-out all-gather "all_gather_single".
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
RANKS_PER_MESSAGE = 2048  # about 0.6 MB of JSON: under the dashboard's 1 MiB per message


@dataclass(frozen=True)
class Place:
    rank: int
    host: str
    dp: int
    tp: int
    pp: int
    cp: int

    def coordinates(self) -> str:
        cp = f" cp={self.cp}" if self.cp else ""
        return f"dp={self.dp} tp={self.tp} pp={self.pp}{cp}"

    def details(self) -> dict:
        return {
            "rank": self.rank,
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "host": self.host,
        }


def gather_places(pc) -> list[Place]:
    """Every rank's host and coordinates, on every rank (once, at start)."""
    mine = Place(
        pc.rank,
        socket.gethostname(),
        pc.dp_rank,
        pc.tp_rank,
        pc.pp_rank,
        int(getattr(pc, "cp_rank", 0)),  # context parallelism, where the context has it
    )
    if pc.world_size == 1:
        return [mine]
    places: list[Place | None] = [None] * pc.world_size
    dist.all_gather_object(places, mine, group=pc.world_group)
    return places  # type: ignore[return-value]


# The phases the trainer and the collectives time (phase_timer.comm_span): a new one needs a
# row in local_row, else its time stays inside compute; `unreported` says so, once per name.
KNOWN_PHASES = frozenset(
    ("step", "pipeline", "tp_comm", "all_to_all", "pp_wait", "dp_gather", "dp_wait",
     "optimizer", "optimizer_comm", "data")
)  # fmt: skip
_warned: set[str] = set()


def unreported(totals: dict[str, float]) -> list[str]:
    """Phases timed but not in FIELDS: logged once each (their time counts as compute)."""
    new = sorted(set(totals) - KNOWN_PHASES - _warned)
    for name in new:
        _warned.add(name)
        logging.getLogger("nanotron_train.telemetry").warning(
            "rank stats: phase %r is timed but has no field (telemetry/rank_stats.py); its "
            "time is counted as compute",
            name,
        )
    return new


def local_row(totals: dict[str, float], steps: int, device, extra: dict) -> list[float]:
    """This rank's FIELDS (NaN = unknown) from an interval's phase totals."""
    n = max(steps, 1)
    unreported(totals)

    def mean(phase: str) -> float:
        return totals.get(phase, 0.0) / n

    # ZeRO-3's parameter all-gathers wait inside the forwards and backwards: dp time, not compute
    inner = mean("tp_comm") + mean("all_to_all") + mean("pp_wait") + mean("dp_gather")
    values = {
        "step_ms": mean("step"),
        "compute_ms": max(0.0, mean("pipeline") - inner),
        "tp_comm_ms": mean("tp_comm"),
        "all_to_all_ms": mean("all_to_all"),  # expert parallel's token exchange
        "pp_wait_ms": mean("pp_wait"),
        "dp_wait_ms": mean("dp_wait") + mean("dp_gather") + mean("optimizer_comm"),
        # the grad-norm all-reduce and ZeRO's all-gather wait (for the slowest rank) inside
        # the optimizer span
        "optimizer_ms": max(0.0, mean("optimizer") - mean("optimizer_comm")),
        "data_ms": mean("data"),
        "mem_bytes": peak_memory_bytes(device),
        "mem_reserved_bytes": (
            torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
        ),
        **extra,
    }
    return [math.nan if values.get(k) is None else float(values[k]) for k in FIELDS]


def gather_rows(row: list[float], pc) -> list[list[float]]:
    """The [world, FIELDS] table, on every rank: one collective."""
    mine = torch.tensor(row, dtype=torch.float64, device=pc.device)
    if pc.world_size == 1:
        return [mine.tolist()]
    table = torch.empty(pc.world_size * len(FIELDS), dtype=torch.float64, device=pc.device)
    _all_gather_tensor(table, mine, group=pc.world_group)
    return table.view(pc.world_size, len(FIELDS)).tolist()


def entries(table: list[list[float]], places: list[Place]) -> list[dict]:
    """The `ranks` of a rank_stats message: NaN becomes null, byte counts integers."""
    out = []
    for place, row in zip(places, table):
        entry: dict = place.details()
        for key, v in zip(FIELDS, row):
            if not math.isfinite(v) or v < 0:
                entry[key] = None
            else:
                entry[key] = int(v) if key in INT_FIELDS else v
        out.append(entry)
    return out


def messages(step: int, time_s: float, interval: int, ranks: list[dict]) -> list[dict]:
    """One rank_stats message per RANKS_PER_MESSAGE ranks (one for any usual world size)."""
    return [
        {
            "type": "rank_stats",
            "step": step,
            "time": time_s,
            "interval": interval,
            "ranks": ranks[i : i + RANKS_PER_MESSAGE],
        }
        for i in range(0, len(ranks), RANKS_PER_MESSAGE)
    ]
