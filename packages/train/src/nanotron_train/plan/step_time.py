"""The step time of a layout: compute, exposed communication and pipeline idle.

* compute: the family's training FLOPs per token (its row) x this rank's tokens per step
  (mbs x m x sequence / (tp x pp x cp): a replica's work split over its ranks), plus one
  more forward of the decoder layers under recompute, over peak x achievable;
* communication (comm.py's bytes over the link the group uses: inside a node when its ranks
  fit one, else the node's network), exposed as each feature overlaps: tp, cp (allgather,
  ulysses), ep and pp transfers in full (they sit between the kernels that need them); the
  cp ring behind the attention it feeds; the dp gradient reduction behind the last
  micro-batch's backward (bucketed, asynchronous); ZeRO-1/2's parameter gather after the
  step in full; ZeRO-3's gathers behind the compute (prefetched one block ahead);
* pipeline idle: the engine row's planned idle share b of the step (`planned_idle(pp, m, v)`)
  added as b / (1 - b) x the busy time;
* optimizer: AdamW's passes over this rank's share of the states (about 28 bytes read and
  written per fp32 state element) at the memory bandwidth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanotron_models.families import family_of
from nanotron_parallel.pipeline import engine
from nanotron_train.plan.comm import collectives
from nanotron_train.plan.devices import Device

EXPOSED = {"tp": 1.0, "ep": 1.0, "pp": 1.0, "zero_gather": 1.0}


@dataclass(frozen=True)
class StepTime:
    compute: float
    exposed_comm: float
    idle: float
    optimizer: float
    comm_by_kind: dict[str, float]
    comm_bytes: dict[str, int]
    # each kind's share of exposed_comm (--calibrate fits a link to the exposed parts it feeds)
    exposed_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.idle + self.optimizer


def _bandwidth(device: Device, intra: bool) -> float:
    bw = device.intra_node_bandwidth if intra else device.inter_node_bandwidth
    return bw * device.link_efficiency


def step_time(cfg, device: Device, gpus_per_node: int, params_rank: int) -> StepTime:
    mc, par, tok = cfg.model.model_config, cfg.parallelism, cfg.tokens
    row = family_of(mc)
    seq, m = tok.sequence_length, tok.batch_accumulation_per_replica
    split = par.tp * par.pp * par.context_parallel_size
    tokens_rank = tok.micro_batch_size * m * seq / split
    per_token = row.training_flops_per_token(mc, seq)
    if par.recompute_layer:  # the layers' forward again: a third of their share
        head = 6 * mc.vocab_size * mc.hidden_size
        per_token += (per_token - head) / 3
    compute = per_token * tokens_rank / (device.peak(cfg.model.dtype) * device.achievable)
    moe = getattr(mc, "moe_config", None)
    layers_rank = -(-mc.num_hidden_layers // par.pp)
    moe_layers = len(moe.moe_layers(mc.num_hidden_layers)) // par.pp if moe else 0
    times: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for c in collectives(cfg, params_rank, moe_layers, layers_rank):
        t = c.bytes * c.factor() / _bandwidth(device, c.intra_node(gpus_per_node))
        times[c.kind] = times.get(c.kind, 0.0) + t
        sizes[c.kind] = sizes.get(c.kind, 0) + c.bytes
    parts = {k: times.get(k, 0.0) * f for k, f in EXPOSED.items()}
    attention_share = 12 * mc.hidden_size * seq * mc.num_hidden_layers / per_token
    cp = times.get("cp", 0.0)
    ring = (par.cp_attention or "allgather") == "ring"
    parts["cp"] = max(0.0, cp - attention_share * compute) if ring else cp
    parts["dp"] = max(0.0, times.get("dp", 0.0) - compute * 2 / 3 / m)
    if cfg.optimizer.zero_stage == 3:
        # prefetched one block ahead: only what the compute cannot hide is exposed
        parts["zero_gather"] = max(0.0, times.get("zero_gather", 0.0) - compute)
    exposed = sum(parts.values())
    eng = engine(par.pp_engine)
    share = eng.planned_idle(par.pp, m, eng.chunks(par.pp_virtual_stages)) if par.pp > 1 else 0.0
    state_elems = params_rank / (
        par.dp * par.context_parallel_size if cfg.optimizer.zero_stage else 1
    )
    optimizer = 28 * state_elems / device.memory_bandwidth
    idle = (compute + exposed) * share / (1 - share) if share < 1 else float("inf")
    return StepTime(compute, exposed, idle, optimizer, times, sizes, parts)
