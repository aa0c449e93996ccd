"""The memory model: peak bytes of the worst rank of a config, before anything is allocated.

One model, two readers: the check before allocation (config/memory_estimate.py, on every
rank) and the layout planner (plan/enumerate.py, for every candidate layout). It aims to err
high: tests/train/test_plan_memory.py runs 14 small layouts (every dimension, ZeRO stage,
recompute setting, engine, both families and MoE) and asserts 0.90-1.25x of the measured peak
of each pp rank (the aim, 0.95-1.15, is met by 10 of 14: docs/planner.md gives the figures).

For each pipeline rank (`estimate` is the largest; `estimate_ranks` lists them):
  * states: this rank's parameters over tp (experts over ep; over dp x cp under ZeRO-3) in
    model.dtype; gradients in fp32 with accumulate_grad_in_fp32, whole during the backward
    whatever the ZeRO stage (ZeRO-2/3 reduce-scatter them at the step's end); AdamW's two fp32
    moments and the fp32 master of low-precision weights, over dp x cp from ZeRO-1 on;
  * activations: per token and layer, what autograd saves (the family row's
    `activation_elements`), for mbs x sequence / cp tokens, times the layers held at once
    (the engine row's in-flight micro-batches x layers; interleaved: its warm-up's chunk
    forwards); under recompute only the layer inputs plus one layer's set;
  * logits: without the fused loss, the fp32 logits and their gradient on the loss rank;
  * workspace: one layer's backward (BACKWARD_SETS x its saved set in fp32, + one set under
    recompute), on the loss rank at least one chunk of the fused loss, a MoE layer's routed
    rows, cp all-gather's whole-sequence K/V, ZeRO-3's two gathered blocks, FRAGMENTATION of
    activations and workspace, and a runtime reserve (RUNTIME_BYTES, + TP_BYTES per extra tp
    rank). The constants were fitted on the CPU (the test's runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanotron_models.config import DTYPES
from nanotron_models.families import family_of
from nanotron_models.moe.config import MoEVariant
from nanotron_models.moe.experts import EXPERT_ACTIVATIONS
from nanotron_parallel.pipeline import engine
from nanotron_parallel.tensor_parallel.linear_cross_entropy import CHUNK_LOGITS

GIB = 2**30
# Fitted on the CPU runs of tests/train/test_plan_memory.py (see the docstring):
RUNTIME_BYTES = 4 * 2**20  # a process's own: gloo buffers, the data's, the allocator's
TP_BYTES = 2 * 2**20  # per tp rank beyond the first: tensor-parallel buffers not counted above
BACKWARD_SETS = 1.75
FRAGMENTATION = 0.03  # of the activations and workspace: freed blocks a larger request cannot reuse


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    in_flight: int  # micro-batches whose activations the worst rank holds at once
    workspace: int = 0  # the backward's working set, gathered blocks, runtime, fragmentation

    @property
    def total(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer + self.activations + self.logits
            + self.workspace
        )  # fmt: skip

    def describe(self) -> str:
        parts = ("parameters", "gradients", "optimizer", "activations", "logits", "workspace")
        return ", ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts) + " GiB"

    def as_dict(self) -> dict[str, int]:
        parts = ("parameters", "gradients", "optimizer", "activations", "logits", "workspace")
        return {p: getattr(self, p) for p in parts} | {"total": self.total}


@dataclass(frozen=True)
class _Shape:
    """What the estimate reads of a config, once."""

    layers: int  # decoder layers on one pp rank (ceil: placement may give one more)
    per_layer: int  # dense parameters of one layer, over tp
    experts: int  # routed-expert parameters of one layer, over ep
    head: int  # one vocabulary table (embedding or lm_head) over tp
    tokens: int  # tokens of one micro-batch on this rank (over cp)
    saved: int  # elements autograd saves per token of one layer
    saved_gathered: int  # the same with the sequence-parallel inputs gathered (recompute)
    layer_input: int  # elements per token of one layer's input
    vocab_shard: int


def _vocab(cfg) -> int:
    div = cfg.model.make_vocab_size_divisible_by
    return -(-cfg.model.model_config.vocab_size // div) * div


def _routed_expert_parameters(mc) -> int:
    """Every routed expert's weights over the model's MoE layers (0 without moe_config)."""
    m = getattr(mc, "moe_config", None)
    if m is None:
        return 0
    # gated experts (SwiGLU) hold 3 matrices of h x I, non-gated ones (relu2) 2
    variant = getattr(mc, "moe_variant", None) or MoEVariant()
    matrices = EXPERT_ACTIVATIONS[variant.expert_activation][1] + 1
    per_layer = m.num_experts * matrices * mc.hidden_size * m.moe_intermediate_size
    return per_layer * len(m.moe_layers(mc.num_hidden_layers))


def _shape(cfg) -> _Shape:
    mc, par, tok = cfg.model.model_config, cfg.parallelism, cfg.tokens
    L, tp = mc.num_hidden_layers, par.tp
    experts = _routed_expert_parameters(mc)
    embeddings = mc.vocab_size * mc.hidden_size * (2 - mc.tie_word_embeddings)
    dense = family_of(mc).num_parameters(mc) - embeddings - mc.hidden_size - experts
    seq = max([tok.sequence_length] + [s.sequence_length or 0 for s in cfg.data_stages])
    saved, layer_input = family_of(mc).activation_elements(mc, tp, par.tp_mode == "REDUCE_SCATTER")
    return _Shape(
        layers=math.ceil(L / par.pp),
        per_layer=-(-dense // L) // tp,
        experts=-(-experts // L) // par.expert_parallel_size,
        head=_vocab(cfg) * mc.hidden_size // tp,
        tokens=tok.micro_batch_size * seq // par.context_parallel_size,
        saved=saved,
        saved_gathered=family_of(mc).activation_elements(mc, tp, False)[0],
        layer_input=layer_input,
        vocab_shard=-(-_vocab(cfg) // tp),
    )


def _rank_parameters(cfg, s: _Shape, first: bool, last: bool) -> int:
    mc = cfg.model.model_config
    heads = int(first) + int(last)
    if cfg.parallelism.pp == 1 and mc.tie_word_embeddings:
        heads = 1
    return s.layers * (s.per_layer + s.experts) + heads * s.head + mc.hidden_size


def _loss_chunk_bytes(cfg, s: _Shape) -> int:
    """The fused loss's one chunk of fp32 logits (logits, softmax, gradient rows)."""
    rows = min(s.tokens, max(1, CHUNK_LOGITS // s.vocab_shard))
    return 3 * 4 * rows * s.vocab_shard


def _held_layer_sets(cfg, s: _Shape, micro_batches: int, stage: int) -> int:
    """Layers' saved sets held at once: micro-batches x layers, or under virtual stages the
    interleaved warm-up's chunk forwards on pp rank r ((pp - r - 1) x 2 + (v - 1) x pp + 1,
    at most m x v) x the layers of one chunk."""
    par = cfg.parallelism
    eng = engine(par.pp_engine)
    v = eng.chunks(par.pp_virtual_stages)
    if not eng.uses_virtual_stages or v == 1:
        return micro_batches * s.layers
    m = cfg.tokens.batch_accumulation_per_replica
    forwards = min(m * v, (par.pp - stage - 1) * 2 + (v - 1) * par.pp + 1)
    return forwards * -(-s.layers // v)


def _backward_bytes(cfg, s: _Shape) -> int:
    """One layer's backward: BACKWARD_SETS of its saved set in fp32 (the gradients of its
    activations, upcast temporaries, blocks freed too late to be reused), and under recompute
    the recomputed set beside them, whose sequence-parallel inputs are gathered again
    (`tp_recompute_allgather`): then counted at their whole-sequence size."""
    if not cfg.parallelism.recompute_layer:
        return int(BACKWARD_SETS * s.tokens * s.saved * 4)
    return int((BACKWARD_SETS + 1) * s.tokens * s.saved_gathered * 4)


def _cp_gather_bytes(cfg, s: _Shape) -> int:
    """cp_attention allgather: the whole sequence's K and V and, backward, their gradients."""
    par, mc = cfg.parallelism, cfg.model.model_config
    cp = par.context_parallel_size
    if cp == 1 or (par.cp_attention or "allgather") != "allgather":
        return 0
    return 4 * 4 * s.tokens * cp * mc.n_kv_heads * mc.head_dim // par.tp


def _moe_dispatch_bytes(cfg, s: _Shape) -> int:
    """A MoE layer's routed rows in fp32 during its backward: the dispatcher's permuted copies
    and the grouped matmul's gradients (top_k x (2 h + 4 moe_intermediate) per token)."""
    mc = cfg.model.model_config
    m = getattr(mc, "moe_config", None)
    if m is None:
        return 0
    return 4 * s.tokens * m.top_k * (2 * mc.hidden_size + 4 * m.moe_intermediate_size)


def in_flight(cfg, stage: int = 0) -> int:
    """Micro-batches whose activations pp rank `stage` holds at once: the engine row's count
    for a pipeline of the stages from this one on (the first rank: the row's own count; 1F1B's
    last: one), or the first rank's on every rank for the zero-bubble engines, whose ranks
    hold up to that peak."""
    par, m = cfg.parallelism, cfg.tokens.batch_accumulation_per_replica
    eng = engine(par.pp_engine)
    return eng.in_flight(m, par.pp if eng.splits_backward else par.pp - stage)


def _rank_estimate(cfg, s: _Shape, stage: int, last: bool) -> MemoryEstimate:
    par, opt = cfg.parallelism, cfg.optimizer
    elem = DTYPES[cfg.model.dtype].itemsize
    dp_cp = par.dp * par.context_parallel_size
    zero = opt.zero_stage
    first = stage == 0
    params = _rank_parameters(cfg, s, first, last)
    grad_bytes = 4 if opt.accumulate_grad_in_fp32 else elem
    # Muon: one momentum for its matrices, AdamW's two for the rest (counted as two); under
    # ZeRO its step holds two fp32 flat buffers of the stage's matrices (optimizer/muon.py).
    name = opt.optimizer_factory.name
    moments = 0 if name == "sgd" else 2
    muon_flat = 8 if name == "muon" and zero >= 1 and dp_cp > 1 else 0
    master = 1 if elem < 4 else 0
    held_mbs = in_flight(cfg, stage)
    layer_sets = _held_layer_sets(cfg, s, held_mbs, stage)
    held = layer_sets * (s.layer_input if par.recompute_layer else s.saved)
    held += s.saved if par.recompute_layer else 0
    activations = s.tokens * held * elem
    work = _backward_bytes(cfg, s)
    if last and cfg.model.fused_linear_cross_entropy:  # at the forward's end, before a backward
        work = max(work, _loss_chunk_bytes(cfg, s))
    work += _moe_dispatch_bytes(cfg, s) + _cp_gather_bytes(cfg, s)
    if zero == 3:  # the running block and the prefetched next, gathered whole
        work += 2 * max(s.per_layer + s.experts, s.head if first or last else 0) * elem
    fused = cfg.model.fused_linear_cross_entropy
    logits = 2 * 4 * s.tokens * s.vocab_shard if last and not fused else 0
    return MemoryEstimate(
        parameters=params * elem // (dp_cp if zero == 3 else 1),
        gradients=params * grad_bytes,
        optimizer=params * 4 * (moments + master) // (dp_cp if zero >= 1 else 1)
        + params * muon_flat,
        activations=activations,
        logits=logits,
        in_flight=held_mbs,
        workspace=work
        + int(FRAGMENTATION * (activations + work))
        + RUNTIME_BYTES
        + TP_BYTES * (par.tp - 1),
    )


def estimate_ranks(cfg) -> list[MemoryEstimate]:
    """The peak of each pipeline rank (ranks of one pp rank differ only by noise)."""
    s = _shape(cfg)
    par = cfg.parallelism
    eng = engine(par.pp_engine)
    loss_rank = eng.last_stage_rank(par.pp, eng.chunks(par.pp_virtual_stages))
    return [_rank_estimate(cfg, s, stage, stage == loss_rank) for stage in range(par.pp)]


def estimate(cfg) -> MemoryEstimate:
    """The peak of the worst pipeline rank."""
    return max(estimate_ranks(cfg), key=lambda e: e.total)
