"""Bytes each collective kind moves per training step on one rank, and the link it uses.

A collective's bytes here are its payload on this rank: an all-reduce's tensor, an all-gather's
or reduce-scatter's whole (gathered) tensor, an all-to-all's sent rows, a p2p send's tensor.
Time on a ring of n ranks: all-reduce 2(n-1)/n x bytes / bandwidth, all-gather, reduce-scatter
and all-to-all (n-1)/n x bytes / bandwidth, p2p bytes / bandwidth.

Per micro-batch of T tokens on the rank (mbs x sequence / cp), hidden h, e bytes per element,
each kind's function below says what it counts. Scalars (the logged loss, the gradient norm)
are left out. tests/train/test_plan_comm.py counts the bytes handed to the process groups'
collectives in a training step (tp all-reduce and sequence parallel, cp all-gather, ring and
Ulysses, ep all-to-all over the ep group, pp sends, dp reductions of dense and expert
gradients, ZeRO's parameter gathers; recompute) and finds these exactly, for Llama, a Mamba-2
hybrid (Mamba-2's cp state passing) and Qwen3-Next (the Gated DeltaNet's). A family's layers
(tp blocks, state-passing bytes) come from its row's `layer_comm`.
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
    m micro-batches, the rank's layers and whether it holds the embedding / the loss; those
    layers' tp blocks per layer, attention layers and cp state-passing bytes per micro-batch
    (_layers: read once per layout, by both _tp and _cp)."""

    T: int
    h: int
    e: int
    m: int
    layers: int
    first: bool
    last: bool
    blocks: float
    attention: int
    state: float


def _layers(cfg, layers: int) -> tuple[float, int, float]:
    """(tp blocks per layer, attention layers, cp state-passing bytes per micro-batch) of the
    rank's `layers`, from the family row's `layer_comm` (the mean over the model's layers:
    exact at pp = 1); without one, every layer an attention block and an MLP block."""
    from nanotron_models.config import DTYPES
    from nanotron_models.families import family_of

    mc, par = cfg.model.model_config, cfg.parallelism
    layer_comm = family_of(mc).layer_comm
    if layer_comm is None:
        return 2.0, layers, 0.0
    rows = layer_comm(mc, par.tp, par.context_parallel_size, 0, cfg.tokens.micro_batch_size,
                      DTYPES[cfg.model.dtype])  # fmt: skip
    share = layers / len(rows)
    blocks = sum(b for b, _ in rows) / len(rows)
    attention = round(sum(c is None for _, c in rows) * share)
    return blocks, attention, sum(c or 0 for _, c in rows) * share


def _tp(cfg, s: _Step) -> list[Collective]:
    """Per micro-batch and layer of b residual blocks (Llama's attention and MLP: 2; a Mamba-2
    hybrid's layer: 1): 2b all-reduces of T x h, + b - 1 under recompute (the recomputed
    forward's, but the layer output's); the embedding's output (first rank) and the fused
    loss's input gradient (loss rank) one each; the loss's row maximum and (target logit, sum
    of exponentials) pair, 3 fp32 per token. Sequence parallel: all-gathers and
    reduce-scatters of the same payload, 5 per block (each block's input gathered and its
    output scattered, their adjoints backward, and the input gathered again for the weight
    gradient), + 2b - 1 under recompute, 2 at each end; the norms' weights, shared by the
    sequence's parts, have their gradients all-reduced (h per norm: one per block and the
    final norm)."""
    par = cfg.parallelism
    if par.tp == 1:
        return []
    blocks = s.blocks
    the, r = s.T * s.h * s.e, int(par.recompute_layer)
    ends = s.first + s.last
    if par.tp_mode == "ALL_REDUCE":
        per_mb = round((2 * blocks + r * (blocks - 1)) * s.layers) * the
        per_mb += ends * the + 12 * s.T * s.last
        return [Collective("tp", "all_reduce", per_mb * s.m, par.tp, 1)]
    per_mb = round((5 * blocks + r * (2 * blocks - 1)) * s.layers) * the + 2 * ends * the
    per_mb += 12 * s.T * s.last
    norms = (round(blocks * s.layers) + s.last) * s.h * s.e
    return [
        Collective("tp", "all_gather", per_mb * s.m, par.tp, 1),
        Collective("tp", "all_reduce", norms * s.m, par.tp, 1),
    ]


def _attention_dims(mc) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of the family's attention layers."""
    view = getattr(mc, "attention_view", None)
    a = view() if callable(view) else mc
    return a.num_attention_heads, a.n_kv_heads, a.head_dim


def _cp(cfg, s: _Step) -> list[Collective]:
    """Per attention layer and micro-batch: all-gather: each layer's K and V of the whole
    sequence (kv heads over tp) gathered forward, gathered again and their gradients reduced
    backward; ring: cp - 1 sends of the local K, V forward, cp - 1 of K, V and cp of dK, dV
    (passed on until they are home) backward (counted at cp = 2 and 4); ulysses: q, k, v (kv
    heads repeated until they split over cp) and the output all-to-all forward and backward
    (counted at cp = 4 with 2 kv heads). A state-passing layer (Mamba-2, Gated DeltaNet) its
    family row's bytes: the conv halo each way and the chunk summaries gathered and reduced.
    A MoE layer's balance statistics (num_experts + 1 fp32) are summed over cp three times."""
    par, mc = cfg.parallelism, cfg.model.model_config
    cp, tp = par.context_parallel_size, par.tp
    if cp == 1:
        return []
    heads, n_kv, head_dim = _attention_dims(mc)
    attention, state = s.attention, s.state
    kv = 2 * s.T * n_kv * head_dim // tp * s.e
    mode = par.cp_attention or "allgather"
    n = attention * s.m
    out = [Collective("cp", "all_gather", round(state * s.m), cp, tp)] if state else []
    moe = getattr(mc, "moe_config", None)
    from nanotron_models.families import family_of

    if moe is not None and family_of(mc).moe_balance_over_cp:
        layers = len(moe.moe_layers(mc.num_hidden_layers)) * s.layers // mc.num_hidden_layers
        out.append(
            Collective("cp", "all_reduce", 12 * (moe.num_experts + 1) * layers * s.m, cp, tp)
        )
    if mode == "allgather":
        return [*out, Collective("cp", "all_gather", 3 * kv * cp * n, cp, tp)]
    if mode == "ring":
        return [*out, Collective("cp", "p2p", (3 * cp - 2) * kv * n, cp, tp)]
    # Ulysses: kv heads that do not split over cp are repeated first (the fewest times)
    kv_heads = n_kv // tp
    kv_heads *= cp // math.gcd(kv_heads, cp)
    qkvo = 2 * s.T * (2 * heads // tp + 2 * kv_heads) * head_dim * s.e
    return [*out, Collective("cp", "all_to_all", qkvo * n, cp, tp)]


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
    # a rank of pp > 1 without chunks sends one way at least: the busiest rank of pp = 2
    # (stage None, both ends) sends its activation or its gradient, equal in bytes
    directions = 2 if chunks > 1 else max(1, (not s.last) + (not s.first))
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
    blocks, attention, state = _layers(cfg, layers_rank)
    s = _Step(
        T=tok.micro_batch_size * tok.sequence_length // par.context_parallel_size,
        h=cfg.model.model_config.hidden_size,
        e=DTYPES[cfg.model.dtype].itemsize,
        m=tok.batch_accumulation_per_replica,
        layers=layers_rank,
        first=stage is None or stage == 0,
        last=stage is None or stage == loss_rank,
        blocks=blocks,
        attention=attention,
        state=state,
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
