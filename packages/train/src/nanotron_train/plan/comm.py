"""Bytes each collective kind moves per training step on one rank, and the link it uses.

A collective's bytes here are its payload on this rank: an all-reduce's tensor, an all-gather's
or reduce-scatter's whole (gathered) tensor, an all-to-all's sent rows, a p2p send's tensor.
Time on a ring of n ranks: all-reduce 2(n-1)/n x bytes / bandwidth, all-gather, reduce-scatter
and all-to-all (n-1)/n x bytes / bandwidth, p2p bytes / bandwidth.

Per micro-batch of T tokens on the rank (mbs x sequence / cp), hidden h, e bytes per element,
each kind's function below says what it counts. Scalars (the logged loss, the gradient norm)
are left out. tests/train/test_plan_comm.py counts the bytes handed to the process groups'
collectives in a training step (tp all-reduce, cp all-gather, ep all-to-all over the ep group,
pp sends, dp reductions of dense and expert gradients, ZeRO's parameter gathers; with
recompute, the cp all-gather, ring and Ulysses, sequence parallel) and finds these exactly
for the Llama family. The state-space families' layers differ (one tp block per layer, the
Mamba-2 and Gated DeltaNet cp exchanges): not modelled yet (docs/planner.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    kind: str  # tp, cp, ep, pp, dp, zero_gather
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, p2p
    bytes: int  # per step on this rank
    group: int  # ranks in the group
    stride: int  # rank distance between neighbours of the group (tp fastest)

    def factor(self) -> float:
        """Bytes on the wire per payload byte (ring algorithms)."""
        n = self.group
        if self.op == "p2p":
            return 1.0
        return (2.0 if self.op == "all_reduce" else 1.0) * (n - 1) / n

    def intra_node(self, gpus_per_node: int) -> bool:
        return self.group * self.stride <= gpus_per_node


@dataclass(frozen=True)
class _Step:
    """What the formulas read: T tokens per micro-batch on the rank, h, e bytes per element,
    m micro-batches, the rank's layers and whether it holds the embedding / the loss."""

    T: int
    h: int
    e: int
    m: int
    layers: int
    first: bool
    last: bool


def _tp(cfg, s: _Step) -> list[Collective]:
    """Per micro-batch: 4 all-reduces of T x h per layer (+1 under recompute); the embedding's
    output (first rank) and the fused loss's input gradient (loss rank) one each; the loss's
    row maximum and (target logit, sum of exponentials) pair, 3 fp32 per token. Sequence
    parallel: the same payloads gathered and reduce-scattered, + the norms' weight gradients
    (a Llama-family layer's two norms; counted at tp = 2)."""
    par = cfg.parallelism
    if par.tp == 1:
        return []
    per_mb = (4 + par.recompute_layer) * s.layers * s.T * s.h * s.e
    per_mb += (s.first + s.last) * s.T * s.h * s.e + (12 * s.T if s.last else 0)
    if par.tp_mode == "ALL_REDUCE":
        return [Collective("tp", "all_reduce", per_mb * s.m, par.tp, 1)]
    # sequence parallel: the same payloads as all-gathers and reduce-scatters, and the norms'
    # weights, shared by the sequence's parts, have their gradients all-reduced (h each: the
    # layer's two norms, and the final norm on the loss rank)
    norms = (2 * s.layers + s.last) * s.h * s.e
    return [
        Collective("tp", "all_gather", per_mb * s.m, par.tp, 1),
        Collective("tp", "all_reduce", norms * s.m, par.tp, 1),
    ]


def _cp(cfg, s: _Step) -> list[Collective]:
    """allgather: each layer's K and V of the whole sequence (kv heads over tp), once per
    micro-batch; ring: cp - 1 sends of the local K, V forward, cp - 1 of K, V and cp of dK, dV
    (passed on until they are home) backward (counted at cp = 2 and 4);
    ulysses: q, k, v (kv heads repeated until they split over cp) and the output all-to-all
    forward and backward (counted at cp = 2 x tp = 2 and cp = 4 with 2 kv heads)."""
    par, mc = cfg.parallelism, cfg.model.model_config
    cp, tp = par.context_parallel_size, par.tp
    if cp == 1:
        return []
    kv = 2 * s.T * mc.n_kv_heads * mc.head_dim // tp * s.e
    mode = par.cp_attention or "allgather"
    n = s.layers * s.m
    if mode == "allgather":
        return [Collective("cp", "all_gather", kv * cp * n, cp, tp)]
    if mode == "ring":
        return [Collective("cp", "p2p", (3 * cp - 2) * kv * n, cp, tp)]
    # Ulysses: kv heads that do not split over cp are repeated first (the fewest times)
    kv_heads = mc.n_kv_heads // tp
    kv_heads *= cp // math.gcd(kv_heads, cp)
    qkvo = 2 * s.T * (2 * mc.num_attention_heads // tp + 2 * kv_heads) * mc.head_dim * s.e
    return [Collective("cp", "all_to_all", qkvo * n, cp, tp)]


def _ep(cfg, s: _Step, moe_layers: int) -> list[Collective]:
    """Per MoE layer and micro-batch the rank's routed rows (T x top_k x h) dispatched and
    combined, forward and backward (x ep for the allgather dispatcher), and the alltoall
    dispatcher's exchange of the per-expert counts (num_experts int64). The rows a rank
    receives depend on the routing: the ep group's sum is exact, one rank's the mean."""
    par, mc = cfg.parallelism, cfg.model.model_config
    moe = getattr(mc, "moe_config", None)
    if par.expert_parallel_size == 1 or moe is None:
        return []
    ep = par.expert_parallel_size
    alltoall = moe.token_dispatcher_type != "allgather"
    rows = (
        4 * s.T * moe.top_k * s.h * s.e * (1 if alltoall else ep) + 8 * moe.num_experts * alltoall
    )
    return [
        Collective(
            "ep", "all_to_all", rows * moe_layers * s.m, ep, par.tp * par.context_parallel_size
        )
    ]


def _pp(cfg, s: _Step) -> list[Collective]:
    """Per chunk and micro-batch the activation sent forward (not from the loss rank) and its
    gradient sent backward (not from the first rank)."""
    par = cfg.parallelism
    if par.pp == 1:
        return []
    chunks = 2 if par.pp_engine == "zbv" else max(1, par.pp_virtual_stages)
    directions = 2 if chunks > 1 else (not s.last) + (not s.first)
    stride = par.tp * par.context_parallel_size * par.dp
    return [Collective("pp", "p2p", directions * s.T * s.h * s.e * chunks * s.m, par.pp, stride)]


def _dp(cfg, s: _Step, params: int) -> list[Collective]:
    """Once per step the rank's gradients (all-reduce; reduce-scatter under ZeRO-2/3); the
    parameters all-gathered after the step (ZeRO-1/2) or before each micro-batch's forward and
    backward (+ recompute's forward) under ZeRO-3; over dp x cp."""
    par, opt = cfg.parallelism, cfg.optimizer
    n = par.dp * par.context_parallel_size
    if n == 1:
        return []
    grad_e = 4 if opt.accumulate_grad_in_fp32 else s.e
    out = [Collective("dp", "reduce_scatter" if opt.zero_stage >= 2 else "all_reduce",
                      params * grad_e, n, par.tp)]  # fmt: skip
    gathers = {0: 0, 1: 1, 2: 1, 3: (2 + par.recompute_layer) * s.m}[opt.zero_stage]
    if gathers:
        out.append(Collective("zero_gather", "all_gather", gathers * params * s.e, n, par.tp))
    return out


def collectives(
    cfg, params_rank: int, moe_layers: int, layers_rank: int, stage: int | None = None
) -> list[Collective]:
    """Pipeline rank `stage`'s collectives of one step, scalars (the logged loss, the gradient
    norm) left out; `stage=None`: the busiest rank (both ends' extras, both pp directions).
    `params_rank`: the rank's parameters (their gradients are reduced)."""
    from nanotron_models.config import DTYPES
    from nanotron_parallel.pipeline import engine

    par, tok = cfg.parallelism, cfg.tokens
    eng = engine(par.pp_engine)
    loss_rank = eng.last_stage_rank(par.pp, eng.chunks(par.pp_virtual_stages))
    s = _Step(
        T=tok.micro_batch_size * tok.sequence_length // par.context_parallel_size,
        h=cfg.model.model_config.hidden_size,
        e=DTYPES[cfg.model.dtype].itemsize,
        m=tok.batch_accumulation_per_replica,
        layers=layers_rank,
        first=stage is None or stage == 0,
        last=stage is None or stage == loss_rank,
    )
    if stage is None and par.pp > 2:
        s = dataclasses.replace(s, first=False, last=False)  # a middle rank: both directions
        extras = [*_tp(cfg, dataclasses.replace(s, first=True, last=True))]
    else:
        extras = _tp(cfg, s)
    return [
        *extras,
        *_cp(cfg, s),
        *_ep(cfg, s, moe_layers),
        *_pp(cfg, s),
        *_dp(cfg, s, params_rank),
    ]
