"""The memory model: peak bytes of the worst rank of a config, before anything is allocated.

One model, two readers: the check before allocation (config/memory_estimate.py, on every
rank) and the layout planner (plan/enumerate.py, for every candidate layout). Its tensor part
(`MemoryEstimate.allocated`) is compared with the peak of the bytes live in torch's CPU
allocator: tests/train/test_plan_memory.py runs 16 small layouts (every dimension, ZeRO stage,
recompute setting, engine, Llama, Qwen2, a Qwen2 MoE, a Mamba-2 hybrid and Qwen3-Next) and
asserts 0.95-1.15x of each pp rank's measured peak (docs/planner.md gives the figures).

For each pipeline rank (`estimate` is the largest; `estimate_ranks` lists them):
  * states: this rank's parameters over tp (experts over ep; over dp x cp under ZeRO-3) in
    model.dtype; gradients in fp32 with accumulate_grad_in_fp32, whole during the backward
    whatever the ZeRO stage (ZeRO-2/3 reduce-scatter them at the step's end); AdamW's two fp32
    moments and the fp32 master of low-precision weights, over dp x cp from ZeRO-1 on;
  * activations: per token, what autograd saves of each layer (the family row's
    `activation_elements`, the mean over the layers), for mbs x sequence / cp tokens, times
    the layers held at once (the engine row's in-flight micro-batches x layers; interleaved:
    its warm-up's chunk forwards); under recompute only the layer inputs plus the largest
    layer's set, recomputed;
  * logits: without the fused loss, the fp32 logits and their gradient on the loss rank;
  * workspace: the larger of the backward's working set (BACKWARD_SETS of the largest layer's
    saved set in fp32) and, on the loss rank, the fused loss's (a chunk of fp32 logits, the
    final norm's saved input and output, the input's gradient, the head's weight gradient);
    cp all-gather's whole-sequence K/V and ZeRO-3's gathered blocks beside it;
  * reserve (not tensors, so not in `allocated`): what the process holds beyond its live
    tensors. On the host, the trainer keeps the heap a step frees (host_memory.py) and the
    heap's high-water mark runs HOST_FRAGMENTATION of the transient bytes above the live
    peak; a CUDA device's caching allocator CUDA_FRAGMENTATION (assumed, not measured here);
    and a runtime reserve (RUNTIME_BYTES, + TP_BYTES per extra tp rank).
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
# Fitted to the allocator peaks of tests/train/test_plan_memory.py's layouts: one layer's
# backward holds about half its saved set again (gradients of its activations, temporaries)
BACKWARD_SETS = 0.6
# Not tensors (the `reserve`, outside the allocator's count): the RSS growth of CPU runs over
# their allocator peak, 0.63-0.68 of the transient bytes (activations, logits, workspace): the
# kept glibc heap's high-water mark over its live blocks (docs/planner.md); rounded up
HOST_FRAGMENTATION = 0.75
CUDA_FRAGMENTATION = 0.1  # the caching allocator's reserved over allocated: assumed
RUNTIME_BYTES = 4 * 2**20  # a process's own: gloo buffers, the data's, the allocator's
TP_BYTES = 2 * 2**20  # per tp rank beyond the first: tensor-parallel buffers not counted above


# the estimate's parts, in the order describe() and as_dict() give them
_PARTS = ("parameters", "gradients", "optimizer", "activations", "logits", "workspace", "reserve")


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    in_flight: int  # micro-batches whose activations the worst rank holds at once
    workspace: int = 0  # the backward's or the loss's working set, gathered blocks
    reserve: int = 0  # not tensors: allocator fragmentation, the runtime's own

    @property
    def allocated(self) -> int:
        """The tensors' bytes at the peak: what the allocator's count of live bytes reads."""
        return (
            self.parameters + self.gradients + self.optimizer + self.activations + self.logits
            + self.workspace
        )  # fmt: skip

    @property
    def total(self) -> int:
        return self.allocated + self.reserve

    def describe(self) -> str:
        return ", ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in _PARTS) + " GiB"

    def largest_part(self) -> tuple[str, int]:
        """The largest of the parts (never the sums `allocated` or `total`)."""
        return max(((p, getattr(self, p)) for p in _PARTS), key=lambda kv: kv[1])

    def as_dict(self) -> dict[str, int]:
        return {p: getattr(self, p) for p in _PARTS} | {
            "allocated": self.allocated,
            "total": self.total,
        }


@dataclass(frozen=True)
class _Shape:
    """What the estimate reads of a config, once."""

    layers: int  # decoder layers on one pp rank (ceil: placement may give one more)
    per_layer: int  # dense parameters of one layer, over tp
    experts: int  # routed-expert parameters of one layer, over ep
    head: int  # one vocabulary table (embedding or lm_head) over tp
    tokens: int  # tokens of one micro-batch on this rank (over cp)
    saved: int  # elements autograd saves per token of a layer, the mean over the layers
    saved_max: int  # the same of the largest layer
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
    per_layer, layer_input = family_of(mc).activation_elements(
        mc, tp, par.tp_mode == "REDUCE_SCATTER"
    )
    return _Shape(
        layers=math.ceil(L / par.pp),
        per_layer=-(-dense // L) // tp,
        experts=-(-experts // L) // par.expert_parallel_size,
        head=_vocab(cfg) * mc.hidden_size // tp,
        tokens=tok.micro_batch_size * seq // par.context_parallel_size,
        saved=-(-sum(per_layer) // len(per_layer)),
        saved_max=max(per_layer),
        layer_input=layer_input,
        vocab_shard=-(-_vocab(cfg) // tp),
    )


def _rank_parameters(cfg, s: _Shape, first: bool, last: bool) -> int:
    mc = cfg.model.model_config
    heads = int(first) + int(last)
    if cfg.parallelism.pp == 1 and mc.tie_word_embeddings:
        heads = 1
    return s.layers * (s.per_layer + s.experts) + heads * s.head + mc.hidden_size


def _loss_bytes(cfg, s: _Shape) -> int:
    """The fused loss's working set at the forward's end: one chunk of fp32 logits (turned in
    place into their gradient)."""
    rows = min(s.tokens, max(1, CHUNK_LOGITS // s.vocab_shard))
    return 4 * rows * s.vocab_shard


def _loss_held_bytes(cfg, s: _Shape) -> int:
    """What the fused loss keeps of each micro-batch until its backward: the final norm's
    saved input and output, the input's gradient (whole sequence) and the head's weight
    gradient (fp32), computed in the forward."""
    h = cfg.model.model_config.hidden_size
    elem = DTYPES[cfg.model.dtype].itemsize
    return s.tokens * (2 * s.layer_input + h) * elem + 4 * s.vocab_shard * h


def _held_forwards(cfg, s: _Shape, micro_batches: int, stage: int) -> tuple[int, int]:
    """(chunk forwards pp rank `stage` holds at once, layers of one chunk): micro-batches x
    the rank's layers, or under virtual stages the interleaved warm-up's chunk forwards
    ((pp - r - 1) x 2 + (v - 1) x pp + 1, at most m x v) x the layers of one chunk."""
    par = cfg.parallelism
    eng = engine(par.pp_engine)
    v = eng.chunks(par.pp_virtual_stages)
    if not eng.uses_virtual_stages or v == 1:
        return micro_batches, s.layers
    m = cfg.tokens.batch_accumulation_per_replica
    forwards = min(m * v, (par.pp - stage - 1) * 2 + (v - 1) * par.pp + 1)
    return forwards, -(-s.layers // v)


def _pipe_edges(cfg, stage: int, last: bool) -> int:
    """Activations a held forward keeps at the pipeline's edges, per token: the input received
    (not on the first stage) and the output kept for the backward (not on the loss stage);
    with several chunks per rank (interleaved, zbv) both, for each chunk."""
    par = cfg.parallelism
    if par.pp == 1:
        return 0
    eng = engine(par.pp_engine)
    chunks = eng.chunks(par.pp_virtual_stages)
    if chunks > 1:  # a held forward is one chunk's (interleaved) or every chunk's (zbv)
        return 2 if eng.uses_virtual_stages else 2 * chunks
    return int(stage > 0) + int(not last)


def _backward_bytes(cfg, s: _Shape) -> int:
    """The largest layer's backward: BACKWARD_SETS of its saved set in fp32 (the gradients of
    its activations, upcast temporaries), and under recompute the recomputed set beside them
    (in the model's dtype; under sequence parallel `tp_recompute_allgather` gathers a
    linear's input again in the backward, one at a time: one of the set's gathered inputs
    held, not two)."""
    if not cfg.parallelism.recompute_layer:
        return int(BACKWARD_SETS * s.tokens * s.saved_max * 4)
    elem = DTYPES[cfg.model.dtype].itemsize
    par = cfg.parallelism
    regathered = 0  # one linear's input at a time, not both of the set's gathered inputs
    if par.tp > 1 and par.tp_mode == "REDUCE_SCATTER":
        regathered = cfg.model.model_config.hidden_size
    return int(s.tokens * ((s.saved_max - regathered) * elem + s.saved_max * BACKWARD_SETS * 4))


def _cp_gather_bytes(cfg, s: _Shape) -> int:
    """cp_attention allgather: the whole sequence's K and V and, backward, their gradients."""
    par, mc = cfg.parallelism, cfg.model.model_config
    cp = par.context_parallel_size
    if cp == 1 or (par.cp_attention or "allgather") != "allgather":
        return 0
    return 4 * 4 * s.tokens * cp * mc.n_kv_heads * mc.head_dim // par.tp


def in_flight(cfg, stage: int = 0) -> int:
    """Micro-batches whose activations pp rank `stage` holds at once: the engine row's count
    for a pipeline of the stages from this one on (the first rank: the row's own count; 1F1B's
    last: one), or the first rank's on every rank for the zero-bubble engines, whose ranks
    hold up to that peak."""
    par, m = cfg.parallelism, cfg.tokens.batch_accumulation_per_replica
    eng = engine(par.pp_engine)
    return eng.in_flight(m, par.pp if eng.splits_backward else par.pp - stage)


def _rank_estimate(cfg, s: _Shape, stage: int, last: bool, fragmentation: float) -> MemoryEstimate:
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
    forwards, chunk_layers = _held_forwards(cfg, s, held_mbs, stage)
    held = forwards * chunk_layers * (s.layer_input if par.recompute_layer else s.saved)
    held += forwards * _pipe_edges(cfg, stage, last) * s.layer_input
    activations = s.tokens * held * elem
    work = _backward_bytes(cfg, s)
    if last and cfg.model.fused_linear_cross_entropy:  # at the forward's end, before a backward
        chunks = engine(par.pp_engine).chunks(par.pp_virtual_stages)
        activations += max(1, forwards // chunks) * _loss_held_bytes(cfg, s)
        work = max(work, _loss_bytes(cfg, s))
    work += _cp_gather_bytes(cfg, s)
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
        workspace=work,
        reserve=int(fragmentation * (activations + work + logits))
        + RUNTIME_BYTES
        + TP_BYTES * (par.tp - 1),
    )


def estimate_ranks(cfg, host: bool = True) -> list[MemoryEstimate]:
    """The peak of each pipeline rank (ranks of one pp rank differ only by noise); `host`: the
    tensors live in host memory (the CPU), else on a CUDA device (its fragmentation)."""
    s = _shape(cfg)
    par = cfg.parallelism
    eng = engine(par.pp_engine)
    loss_rank = eng.last_stage_rank(par.pp, eng.chunks(par.pp_virtual_stages))
    frag = HOST_FRAGMENTATION if host else CUDA_FRAGMENTATION
    return [_rank_estimate(cfg, s, stage, stage == loss_rank, frag) for stage in range(par.pp)]


def estimate(cfg, host: bool = True) -> MemoryEstimate:
    """The peak of the worst pipeline rank."""
    return max(estimate_ranks(cfg, host), key=lambda e: e.total)
