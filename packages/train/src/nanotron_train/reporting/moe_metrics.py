"""Expert load metrics of a logged step: tokens per expert, aux loss, z-loss, load imbalance.

Each MoE block keeps device statistics over the step's micro-batches (`stats`: `load`, the
(token, slot) assignments to each global expert from this rank's tokens; `aux_loss` and
`z_loss`, sums over micro-batches of their values before any coefficient; `micro_batches`),
reset by the trainer at the start of every step. Nothing is read during the step. On a logged
step every rank packs them into ONE [num_hidden_layers, E + 3] float64 tensor (row l: layer l's load
over the experts, then its aux and z sums and its micro-batch count; zero where this rank does
not hold layer l) and one all-reduce over the world gives every rank the step's totals. The
weights make that sum count each token once:

- load: ranks holding different tokens add theirs (dp, which contains ep; cp; tp under
  sequence parallel, where each tp rank routes its sequence shard). Under tp ALL_REDUCE
  every tp rank routes the same tokens: only tp rank 0 adds its counts.
- aux / z: a micro-batch's value is already the whole sequence's (the block reduces its
  statistics over tp and cp), so only tp rank 0 and cp rank 0 add it; the mean is over the
  dp replicas' micro-batches (dp * micro_batches of them).
- pp: a layer lives on one stage; the other stages add zeros, so the sum is the gather.

Per layer, imbalance = max / mean of its expert loads (1 = uniform, E = one expert takes
everything). Every MoE layer sees the same number of assignments (tokens x top_k), so the
overall `moe/load_imbalance` (max over all layers' experts / their mean) is the worst layer's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nanotron_models.moe.stats import moe_blocks
from nanotron_train.reporting.dashboard_spool import LOAD_KEY

# The keys the record gains (docs/dashboard.md lists them); `moe_load` (LOAD_KEY) is not a
# scalar: the metrics file keeps it, the dashboard client sends it as a `moe_load` message
# (dashboard_spool.py), TensorBoard and wandb (scalars only) skip it.


class MoEMetrics:
    """The packing, the one reduction and the record's values (see the module docstring).

    `blocks`: this rank's [(global layer index, MoE block)]; `num_layers`, `num_experts`: the
    model's, the same on every rank (a pp stage without MoE layers still joins the reduction).
    """

    def __init__(self, blocks, num_layers: int, num_experts: int, pc, sequence_parallel: bool,
                 z_loss: bool) -> None:  # fmt: skip
        self.blocks, self.pc, self.z_loss = list(blocks), pc, z_loss
        self.shape = (num_layers, num_experts + 3)
        self.num_experts = num_experts
        self.weight_load = 1.0 if sequence_parallel or pc.tp_rank == 0 else 0.0
        cp_rank = getattr(pc, "cp_rank", 0)
        self.weight_loss = 1.0 if pc.tp_rank == 0 and cp_rank == 0 else 0.0

    def _packed(self) -> torch.Tensor:
        """This rank's weighted contribution, on the device (no host read)."""
        packed = torch.zeros(self.shape, dtype=torch.float64, device=self.pc.device)
        # a block's tensors exist from its first training forward on
        held = [(layer, b.stats) for layer, b in self.blocks if b.stats.load is not None]
        if not held:
            return packed
        loads = torch.stack([st.load for _, st in held]).double() * self.weight_load
        losses = torch.stack([torch.stack([st.aux_loss, st.z_loss]) for _, st in held]).double()
        counts = [[float(st.micro_batches)] for _, st in held]
        mbs = torch.tensor(counts, dtype=torch.float64, device=packed.device)
        mine = torch.cat([loads, losses * self.weight_loss, mbs * self.weight_loss], dim=1)
        rows = torch.tensor([layer for layer, _ in held], device=packed.device)
        return packed.index_copy_(0, rows, mine.detach())

    def collect(self) -> dict[str, Any]:
        """The record's MoE values (collective over the world: every rank, same steps)."""
        packed = self._packed()
        if self.pc.world_size > 1:
            dist.all_reduce(packed, group=self.pc.world_group)
        return self.values(packed.cpu())

    def values(self, packed: torch.Tensor) -> dict[str, Any]:
        """From the reduced [layers, E + 3] table: per-layer and overall values."""
        e = self.num_experts
        rows = {i: row for i, row in enumerate(packed.tolist()) if row[e + 2] > 0}
        if not rows:
            return {}
        out: dict[str, Any] = {}
        for layer, row in rows.items():
            out[f"moe/layer_{layer}/aux_loss"] = row[e] / row[e + 2]
            out[f"moe/layer_{layer}/load_imbalance"] = imbalance_of(row[:e])
            if self.z_loss:
                out[f"moe/layer_{layer}/z_loss"] = row[e + 1] / row[e + 2]
        out["moe/aux_loss"] = sum(row[e] / row[e + 2] for row in rows.values()) / len(rows)
        if self.z_loss:
            out["moe/z_loss"] = sum(row[e + 1] / row[e + 2] for row in rows.values()) / len(rows)
        out["moe/load_imbalance"] = max(out[f"moe/layer_{i}/load_imbalance"] for i in rows)
        out[LOAD_KEY] = {str(i): [int(round(v)) for v in row[:e]] for i, row in rows.items()}
        return out


def imbalance_of(load: list[float]) -> float:
    """max / mean of one layer's expert loads (NaN when no token was routed)."""
    mean = sum(load) / len(load)
    return max(load) / mean if mean > 0 else float("nan")


def build_moe_metrics(cfg, pc, model) -> MoEMetrics | None:
    """The trainer's MoEMetrics, or None for a model without `moe_config` (nothing to do)."""
    mc = cfg.model.model_config
    moe = getattr(mc, "moe_config", None)
    if moe is None:
        return None
    return MoEMetrics(
        moe_blocks(model),
        mc.num_hidden_layers,
        moe.num_experts,
        pc,
        sequence_parallel=cfg.parallelism.tp_mode == "REDUCE_SCATTER",
        z_loss=(getattr(moe, "router_z_loss_coef", 0.0) or 0.0) > 0,
    )
