"""MoEBlock: the mixture-of-experts MLP of a decoder layer (Qwen2-MoE's sparse block).

out = sum over the token's top-k experts of weight * expert(x)  [+ sigmoid(x . g) * shared(x)]

A family may change the router's group limit, the weights' scale and the experts' activation
(`MoEVariant`) and give its own shared expert, added without a gate (Nemotron-H: relu2
experts, an ungated relu2 shared MLP).

Dropless: every (token, slot) reaches its expert whatever the imbalance; the dispatcher sorts
the assignments by expert (one rank) or sends them to the experts' ranks (expert parallel).

Tensor parallelism: the router and the routed experts are replicated over tp (experts are
small matmuls that tp would only make smaller); the shared expert is the dense layer's
tp-sharded MLP. Under sequence parallel (REDUCE_SCATTER) the block sees this tp rank's
sequence shard: it routes its own tokens, and the replicated weights (router, experts, shared
gate) are read through copy_to_tp so their gradients are summed over tp, as RMSNorm's weight.
Under ALL_REDUCE every tp rank holds every token and computes the same thing.

The balance losses (balance.py) are over the micro-batch's tokens of the whole sequences:
summed over tp under sequence parallel and over cp under context parallel. They are computed
only while autograd records (training) and reach the router's gradient through
`scale_balance_grad` with `aux_scale` = the factor of one micro-batch's lm loss (the trainer
sets it: stats.begin_moe_step). `stats` accumulates this rank's load and the losses over a
step's micro-batches on the device (stats.py), never during a recompute's second forward.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from nanotron_parallel.expert_parallel.dispatch import Dispatcher, LocalDispatcher, expert_counts
from nanotron_parallel.tensor_parallel import TensorParallelLinearMode, copy_to_tp

from ..blocks import MLP
from ..probes import ROUTER_ENTROPY, routing_entropy_sums
from .balance import balance_losses, scale_balance_grad
from .config import MoEVariant
from .experts import GroupedExperts
from .router import Router
from .stats import MoEStats


class MoEBlock(nn.Module):
    probe_stat, probe = ROUTER_ENTROPY, None  # a detail step's router entropy (probes.py)

    def __init__(
        self,
        config,
        layer: int,
        group,
        mode,
        dispatcher: Dispatcher | None = None,
        device=None,
        dtype=None,
        *,
        variant: MoEVariant | None = None,
        shared_expert: nn.Module | None = None,
    ):
        super().__init__()
        m, h = config.moe_config, config.hidden_size
        v = variant or MoEVariant()
        self.layer, self.group = layer, group
        self.num_experts, self.top_k = m.num_experts, m.top_k
        self.dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(m.num_experts)
        self.sequence_parallel = mode == TensorParallelLinearMode.REDUCE_SCATTER
        self.cp_group = None  # set_context_parallel
        kw = {"device": device, "dtype": dtype}
        self.router = Router(
            h, m.num_experts, m.top_k, m.router, m.norm_topk_prob, m.router_bias_update_rate, **kw,
            n_group=v.n_group, topk_group=v.topk_group,
            routed_scaling_factor=v.routed_scaling_factor,
        )  # fmt: skip
        d = self.dispatcher
        self.experts = GroupedExperts(
            d.num_local_experts, d.first_local_expert, h, m.moe_intermediate_size, **kw,
            activation=v.expert_activation,
        )  # fmt: skip
        if shared_expert is not None:  # the family's, ungated
            self.shared_expert = shared_expert
        elif m.enable_shared_expert:
            size = SimpleNamespace(
                hidden_size=h, intermediate_size=m.shared_expert_intermediate_size
            )
            self.shared_expert = MLP(size, group, mode, **kw)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False, **kw)
        self.aux_coef, self.z_coef = float(m.router_aux_loss_coef), float(m.router_z_loss_coef)
        self.aux_scale = 1.0  # the factor of one micro-batch's lm loss (begin_moe_step)
        self.stats = MoEStats(m.num_experts)

    def set_context_parallel(self, group, size: int) -> None:
        """The micro-batch's tokens are split over `group` (size > 1): the balance losses sum
        their statistics over it."""
        self.cp_group = group if size > 1 else None

    def _read(self, weight: torch.Tensor) -> torch.Tensor:
        """A replicated weight as this forward reads it: under sequence parallel its gradient
        (from this rank's tokens only) is summed over tp."""
        if self.sequence_parallel and torch.distributed.get_world_size(self.group) > 1:
            return copy_to_tp(weight, self.group)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat, self._read(self.router.weight))
        if self.probe is not None and torch._C._current_graph_task_id() == -1:  # not a recompute
            self.probe.add_(routing_entropy_sums(routing.probs))
        sent = self.dispatcher.dispatch(flat, routing.topk_idx, routing.topk_weight)
        y = self.experts(
            sent.tokens,
            sent.counts,
            self._read(self.experts.first_proj),
            self._read(self.experts.down_proj),
        )
        out = self.dispatcher.combine(y, sent.state)
        if hasattr(self, "shared_expert_gate"):
            gate = torch.sigmoid(F.linear(flat, self._read(self.shared_expert_gate.weight)))
            out = out + gate * self.shared_expert(x).reshape(flat.shape)
        elif hasattr(self, "shared_expert"):
            out = out + self.shared_expert(x).reshape(flat.shape)
        out = out.view(shape)
        if torch.is_grad_enabled():
            out = self._balance(out, routing)
        return out

    def _balance(self, out: torch.Tensor, routing) -> torch.Tensor:
        counts = expert_counts(routing.topk_idx.reshape(-1), self.num_experts)
        sp_group = self.group if self.sequence_parallel else None
        if sp_group is not None and torch.distributed.get_world_size(sp_group) == 1:
            sp_group = None
        aux, z = balance_losses(routing.logits, routing.probs, counts, sp_group, self.cp_group)
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside a backward
            self.stats.add(counts, aux.detach(), z.detach())
        loss = self.aux_coef * aux + self.z_coef * z
        if loss.requires_grad and (self.aux_coef or self.z_coef):
            out = scale_balance_grad(out, loss, self.aux_scale)
        return out
