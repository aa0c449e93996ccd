"""Per-layer statistics of a detail step: Nanotron's `metrics_logging` section (log_level 1,
every log_detail_interval steps), reduced over the whole layout.

Per parameter (its global name, the same in every layout): the weight norm (the values the
step's gradient was taken at), the gradient norm (the data-parallel mean, before clipping) and
the update/weight ratio ||W_after - W_before|| / ||W_before||; per block (`decoder.3`): the
RMS of its output activations over the step's tokens and micro-batches; per attention layer
(`decoder.3.attn`) the largest pre-softmax logit q.k/sqrt(d), per router (`decoder.3.mlp`) the
mean over tokens of its routing distribution's entropy (nanotron_models/probes.py: the layers
measure them in place while the trainer's `probe` views are set, on detail steps only).

Layouts: each rank adds the squares of the elements it counts in the global gradient norm
(`grads.norm_pieces`: a tp-replicated parameter on tp rank 0, a tied one on its first stage,
each dp shard or 1/dp of a replicated buffer once), so the world sum counts every element once
and pp stages holding other layers add zeros; activations add sums of squares and element
counts over the ranks that hold different tokens (dp, cp; tp under sequence parallel, where
each tp rank holds a slice of the sequence; under tp ALL_REDUCE tp rank 0 alone), and so do
the routers' entropies and token counts; the max logit is the maximum over every rank (tp ranks
hold other heads, dp/cp ranks other tokens, a stage without the layer -inf). All of it is ONE
float64 tensor and ONE collective over the world per detail step (an all-reduce; an all-gather,
summed and maxed on the device, when there are maxima), read on the host once. Under context
parallelism each attention shows the layer every block of scores it computes (nanotron_parallel's
`observe`: the all-gather's and Ulysses' kernel calls, the ring's blocks), each rank its queries
or heads against the keys they see, so the maximum over the ranks is one process's.

Under `model.compile` there is no activation RMS: a hook added to a compiled block for one
step would recompile it. Cost: nothing on other steps (no hook is registered, nothing is read). On a detail step the
output hooks run for its forward passes (a recomputed forward adds its identical values to
the sums and the counts, so the RMS is unchanged), and the counted pieces are copied once to
measure the update.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanotron_models.probes import ATTN_MAX_LOGIT, ROUTER_ENTROPY, detail_probes
from nanotron_parallel.clip import default_counts_in_norm
from nanotron_train.reporting.layer_message import LAYER_KEY

PARAM_STATS = ("weight_norm", "grad_norm", "update_ratio")


def _world_rows(local: list[tuple[str, bool]], pc) -> list[str]:
    """The names some rank counts (`local`: this rank's (name, counted) in model order),
    ordered as the model: every rank's list in rank order (pp stages in model order), a name
    placed where it first appears even where that rank does not count it (a ZeRO shard)."""
    gathered = [local]
    if pc.world_size > 1:
        gathered = [None] * pc.world_size
        dist.all_gather_object(gathered, local, group=pc.world_group)
    order: dict[str, None] = {}
    counted: set[str] = set()
    for names in gathered:
        order.update(dict.fromkeys(n for n, _ in names))
        counted.update(n for n, c in names if c)
    return [n for n in order if n in counted]


def _f64_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64)


class LayerStats:
    """The detail step's statistics (see the module docstring). Collective at construction and
    in `collect`: every rank, the same steps."""

    def __init__(self, model: nn.Module, grads, named_params, pc, interval: int,
                 hidden_size: int, sequence_parallel: bool, activations: bool = True,
                 ) -> None:  # fmt: skip
        self.pc, self.interval, self.hidden = pc, interval, hidden_size
        name_of = {id(p): n for n, p in named_params}
        counts = default_counts_in_norm(pc.tp_rank, pc.is_first_stage)
        self.pieces = [x for x in grads.norm_pieces(counts) if id(x.param) in name_of]
        held = {id(x.param) for x in self.pieces}
        self.params = _world_rows([(n, id(p) in held) for n, p in named_params], pc)
        index = {n: i for i, n in enumerate(self.params)}
        rows = [index[name_of[id(x.param)]] for x in self.pieces]
        self.piece_rows = torch.tensor(rows, dtype=torch.long, device=pc.device)
        # compiled blocks get no hook: adding and removing one would recompile them
        names = list(getattr(model, "block_names", [])) if activations else []
        self.blocks = [(model.get_submodule(n), n) for n in names]
        self.block_rows = _world_rows([(n, True) for n in names], pc)
        self.block_index = {n: i for i, n in enumerate(self.block_rows)}
        # under ALL_REDUCE every tp rank holds the same activations: tp rank 0 adds them
        self.act_weight = 1.0 if sequence_parallel or pc.tp_rank == 0 else 0.0
        self._init_probes(model if activations else None)
        self._hooks: list[Any] = []
        self._packed: torch.Tensor | None = None
        self._before: list[torch.Tensor] | None = None

    def _init_probes(self, model: nn.Module | None) -> None:
        """Attention layers (max logit, every rank: tp ranks hold other heads) and routers
        (entropy; under ALL_REDUCE tp rank 0 alone, as the activations), by module name."""
        probes = detail_probes(model) if model is not None else []
        attn = [(n, m) for n, m in probes if m.probe_stat == ATTN_MAX_LOGIT]
        routers = [(n, m) for n, m in probes if m.probe_stat == ROUTER_ENTROPY]
        self.attn_rows = _world_rows([(n, True) for n, _ in attn], self.pc)
        self.router_rows = _world_rows([(n, True) for n, _ in routers], self.pc)
        a_index = {n: i for i, n in enumerate(self.attn_rows)}
        r_index = {n: i for i, n in enumerate(self.router_rows)}
        self.attn_probes = [(m, a_index[n]) for n, m in attn]
        self.router_probes = [(m, r_index[n]) for n, m in routers] if self.act_weight else []

    def _sizes(self) -> tuple[int, int]:
        """(summed values, maxima) of the packed tensor: [3p | 2b | 2r] summed, [a] maxima."""
        p, b = len(self.params), len(self.block_rows)
        return 3 * p + 2 * b + 2 * len(self.router_rows), len(self.attn_rows)

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    # -- the detail step, in the trainer's order ---------------------------------------------
    def watch(self) -> None:
        """Before the step's forward passes: zero the packed sums, hook the blocks' outputs."""
        p, b = len(self.params), len(self.block_rows)
        summed, maxima = self._sizes()
        self._packed = torch.zeros(summed + maxima, dtype=torch.float64, device=self.pc.device)
        act = self._packed[3 * p : 3 * p + 2 * b].view(2, b)
        for block, name in self.blocks:
            row = self.block_index[name]
            self._hooks.append(block.register_forward_hook(self._on_output(act, row)))
        # the probes write in place into their slots (nanotron_models/probes.py)
        entropy = self._packed[3 * p + 2 * b : summed].view(-1, 2)
        for module, row in self.router_probes:
            module.probe = entropy[row]
        self._packed[summed:] = float("-inf")  # a layer this rank does not hold
        for module, row in self.attn_probes:
            module.probe = self._packed[summed + row]

    def _on_output(self, act: torch.Tensor, row: int):
        def hook(_module, _inputs, out) -> None:
            x = out[0] if isinstance(out, tuple) else out
            if not isinstance(x, torch.Tensor) or x.shape[-1:] != (self.hidden,):
                return  # not a hidden state (logits, a loss)
            with torch.no_grad():
                act[0, row] += _f64_norm(x.detach()).square() * self.act_weight
                act[1, row] += x.numel() * self.act_weight

        return hook

    def unwatch(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for module, _ in self.attn_probes + self.router_probes:
            module.probe = None

    @torch.no_grad()
    def before_update(self) -> None:
        """After the gradients are reduced, before clipping and the optimizer step."""
        p = len(self.params)
        if self.pieces:
            w = torch.stack([_f64_norm(x.value) for x in self.pieces]).square()
            g = torch.stack([_f64_norm(x.grad) for x in self.pieces]).square()
            self._packed[:p].index_add_(0, self.piece_rows, w)
            self._packed[p : 2 * p].index_add_(0, self.piece_rows, g)
        self._before = [x.value.clone() for x in self.pieces]

    @torch.no_grad()
    def after_update(self) -> None:
        """After the optimizer step (or none: a skipped step's update is zero)."""
        p = len(self.params)
        if self.pieces:
            u = [_f64_norm(x.value - old) for x, old in zip(self.pieces, self._before)]
            self._packed[2 * p : 3 * p].index_add_(0, self.piece_rows, torch.stack(u).square())
        self._before = None

    def collect(self) -> dict[str, Any]:
        """The record's LAYER_KEY entry after a detail step, {} otherwise (collective: the
        same steps on every rank)."""
        packed, self._packed = self._packed, None
        if packed is None:
            return {}
        if self.pc.world_size > 1:
            packed = self._reduce(packed)
        return {LAYER_KEY: self.values(packed.cpu().tolist())}

    def _reduce(self, packed: torch.Tensor) -> torch.Tensor:
        """The world's sums and maxima: one all-reduce, or with maxima one all-gather (the
        packed values of every rank, summed and maxed here)."""
        summed, maxima = self._sizes()
        if not maxima:
            dist.all_reduce(packed, group=self.pc.world_group)
            return packed
        ranks = [torch.empty_like(packed) for _ in range(self.pc.world_size)]
        dist.all_gather(ranks, packed, group=self.pc.world_group)
        every = torch.stack(ranks)
        return torch.cat([every[:, :summed].sum(0), every[:, summed:].amax(0)])

    def values(self, packed: list[float]) -> dict[str, dict[str, float]]:
        p, b = len(self.params), len(self.block_rows)
        w, g, u = packed[:p], packed[p : 2 * p], packed[2 * p : 3 * p]
        sums, counts = packed[3 * p : 3 * p + b], packed[3 * p + b :]
        out: dict[str, dict[str, float]] = {k: {} for k in PARAM_STATS}
        for i, name in enumerate(self.params):
            out["weight_norm"][name] = w[i] ** 0.5
            out["grad_norm"][name] = g[i] ** 0.5
            out["update_ratio"][name] = (u[i] / w[i]) ** 0.5 if w[i] > 0 else float("nan")
        act = {n: (sums[i] / counts[i]) ** 0.5 for i, n in enumerate(self.block_rows) if counts[i]}
        summed, _ = self._sizes()
        ent = packed[3 * p + 2 * b : summed]
        rows = enumerate(self.router_rows)
        router = {n: ent[2 * i] / ent[2 * i + 1] for i, n in rows if ent[2 * i + 1]}
        # -inf: no rank measured the layer (none ran its forward)
        logits = {n: v for n, v in zip(self.attn_rows, packed[summed:]) if v != float("-inf")}
        probed = {"act_rms": act, ROUTER_ENTROPY: router, ATTN_MAX_LOGIT: logits}
        return out | {k: v for k, v in probed.items() if v}


def build_layer_stats(cfg, pc, model, grads, named_params) -> LayerStats | None:
    """The trainer's LayerStats under `metrics_logging.log_level: 1`, else None."""
    ml = cfg.metrics_logging
    if ml is None or ml.log_level != 1:
        return None
    return LayerStats(
        model,
        grads,
        named_params,
        pc,
        ml.log_detail_interval,
        cfg.model.model_config.hidden_size,
        sequence_parallel=cfg.parallelism.tp_mode == "REDUCE_SCATTER",
        activations=not cfg.model.compile,
    )
