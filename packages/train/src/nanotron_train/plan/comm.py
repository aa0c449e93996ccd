"""Bytes each collective kind moves per training step on one rank, and the link it uses.

A collective's bytes here are its payload on this rank: an all-reduce's tensor, an all-gather's
or reduce-scatter's whole (gathered) tensor, an all-to-all's sent rows, a p2p send's tensor.
Time on a ring of n ranks: all-reduce 2(n-1)/n x bytes / bandwidth, all-gather, reduce-scatter
and all-to-all (n-1)/n x bytes / bandwidth, p2p bytes / bandwidth.

Per micro-batch of T tokens on the rank (mbs x sequence / cp), hidden h, e bytes per element:
  * tp (ALL_REDUCE): per layer 2 all-reduces of T x h forward (attention and MLP outputs) and
    2 backward (their inputs' gradients), +2 forward ones under recompute; REDUCE_SCATTER: the
    same bytes as all-gathers and reduce-scatters;
  * cp: allgather: K and V (kv heads over tp) of the whole sequence gathered once forward,
    once backward, and dK, dV reduce-scattered; ring: cp - 1 sends of the local K and V
    forward, K, V, dK, dV backward; ulysses: q, k, v and the output all-to-all each way;
  * ep: per MoE layer the token rows (T x top_k x h) dispatched and combined forward, and
    their gradients backward (x ep for the allgather dispatcher);
  * pp: per chunk and micro-batch the activation sent forward and its gradient backward;
  * dp: once per step the gradients (all-reduce; reduce-scatter under ZeRO-2/3); the
    parameters all-gathered after the step (ZeRO-1/2) or before each micro-batch's forward and
    backward (ZeRO-3), over dp x cp.
"""

from __future__ import annotations

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


def collectives(
    cfg, num_parameters_rank: int, moe_layers: int, layers_rank: int
) -> list[Collective]:
    """This rank's collectives of one step (those of a group of one are left out)."""
    par, tok, mc = cfg.parallelism, cfg.tokens, cfg.model.model_config
    from nanotron_models.config import DTYPES

    e = DTYPES[cfg.model.dtype].itemsize
    tp, pp, cp, dp, ep = par.tp, par.pp, par.context_parallel_size, par.dp, par.expert_parallel_size
    m = tok.batch_accumulation_per_replica
    T = tok.micro_batch_size * tok.sequence_length // cp
    h = mc.hidden_size
    out: list[Collective] = []
    if tp > 1:
        per_layer = (4 + 2 * par.recompute_layer) * T * h * e
        op = "all_reduce" if par.tp_mode == "ALL_REDUCE" else "all_gather"
        out.append(Collective("tp", op, per_layer * layers_rank * m, tp, 1))
    if cp > 1:
        kv = 2 * T * mc.n_kv_heads * mc.head_dim // tp * e
        mode = par.cp_attention or "allgather"
        if mode == "allgather":
            out.append(Collective("cp", "all_gather", 3 * kv * cp * layers_rank * m, cp, tp))
        elif mode == "ring":
            out.append(Collective("cp", "p2p", 3 * kv * (cp - 1) * layers_rank * m, cp, tp))
        else:
            qkvo = 2 * T * (2 * mc.num_attention_heads + 2 * mc.n_kv_heads) * mc.head_dim // tp * e
            out.append(Collective("cp", "all_to_all", qkvo * layers_rank * m, cp, tp))
    moe = getattr(mc, "moe_config", None)
    if ep > 1 and moe is not None:
        rows = 4 * T * moe.top_k * h * e * (ep if moe.token_dispatcher_type == "allgather" else 1)
        out.append(Collective("ep", "all_to_all", rows * moe_layers * m, ep, tp * cp))
    if pp > 1:
        chunks = 2 if par.pp_engine == "zbv" else max(1, par.pp_virtual_stages)
        out.append(Collective("pp", "p2p", 2 * T * h * e * chunks * m, pp, tp * cp * dp))
    if dp * cp > 1:
        grad_e = 4 if cfg.optimizer.accumulate_grad_in_fp32 else e
        zero = cfg.optimizer.zero_stage
        op = "reduce_scatter" if zero >= 2 else "all_reduce"
        out.append(Collective("dp", op, num_parameters_rank * grad_e, dp * cp, tp))
        gathers = {0: 0, 1: 1, 2: 1, 3: (2 + par.recompute_layer) * m}[zero]
        if gathers:
            out.append(
                Collective(
                    "zero_gather", "all_gather", gathers * num_parameters_rank * e, dp * cp, tp
                )
            )
    return out
