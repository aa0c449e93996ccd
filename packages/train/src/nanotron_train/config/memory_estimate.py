"""The memory a config needs per rank, checked against the machine before anything is allocated.

A sequence length or micro-batch too large for the machine otherwise grows the process for
minutes until the kernel or the allocator kills it. `check_memory` (the trainer's first step,
on every rank) compares `estimate(cfg)` with what the device has free: on CUDA,
torch.cuda.mem_get_info of the rank's device; on the CPU, /proc/meminfo's MemAvailable shared
by the ranks on the host. When the estimate is larger the run stops in one line with both
figures; `general.ignore_memory_check: true` (named after Nanotron's `ignore_sanity_checks`
beside it) skips the check for a machine where the estimate is known to be pessimistic.

The estimate, for the worst rank (the first pipeline stage, which holds the most micro-batches
in flight; the embedding and the head are both counted):
  * parameters: this stage's share over tp (and over dp x cp under ZeRO-3), in model.dtype;
  * gradients: the same count, in fp32 with optimizer.accumulate_grad_in_fp32 (ZeRO-2/3
    shard them over dp x cp);
  * optimizer: AdamW's two fp32 moments plus an fp32 master copy of low-precision weights,
    sharded over dp x cp from ZeRO-1 on;
  * activations: per token and layer, the tensors autograd saves (the family's count, its
    row's `activation_elements`; for Llama: norm inputs and outputs, q, k, v, attention
    output, the MLP's gate, up and product; the hidden-size ones split over tp only in
    REDUCE_SCATTER mode), for mbs x sequence / cp tokens, times the micro-batches in
    flight (afab: all of them; 1f1b: pp; interleaved: 2 pp), only layer inputs under
    recompute_layer plus one layer's whole set, and one layer's set again in fp32 for the
    backward's working set; attention itself is taken as O(sequence) (flash / SDPA kernels),
    not the sequence-squared score matrix;
  * logits: the fp32 logits and their gradient over the vocabulary shard, unless
    model.fused_linear_cross_entropy computes the loss chunk by chunk.
On the CPU the estimate came out at 0.6-0.9x the measured growth of the peak RSS over a
training step (fp32 and bf16, afab and 1f1b, recompute, fused or not): it errs low, so it
refuses only configs that clearly cannot fit (a config 10x too large, not 10% too large).
tests/train/test_memory_estimate.py measures that ratio on a small model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanotron_models.config import DTYPES
from nanotron_models.families import family_of
from nanotron_parallel.pipeline import engine

GIB = 2**30
MEMINFO = "/proc/meminfo"


class MemoryCheckError(ValueError):
    """The config needs more memory than the machine has; the message gives both figures."""


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    in_flight: int  # micro-batches whose activations are held at once

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.logits

    def describe(self) -> str:
        parts = ("parameters", "gradients", "optimizer", "activations", "logits")
        return ", ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts) + " GiB"


def _stage_parameters(cfg) -> int:
    """Parameters of the largest pipeline stage over tp (embedding and head both counted)."""
    mc = cfg.model.model_config
    par = cfg.parallelism
    div = cfg.model.make_vocab_size_divisible_by
    vocab = -(-mc.vocab_size // div) * div
    experts = _routed_expert_parameters(mc)  # replicated over tp, split over ep
    per_layer = (family_of(mc).num_parameters(mc) - mc.vocab_size * mc.hidden_size * (2 - mc.tie_word_embeddings)
                 - mc.hidden_size - experts) // mc.num_hidden_layers  # fmt: skip
    layers = math.ceil(mc.num_hidden_layers / par.pp)
    heads = 1 if (par.pp == 1 and mc.tie_word_embeddings) else 2
    expert_share = experts * layers // mc.num_hidden_layers // par.expert_parallel_size
    return (layers * per_layer + heads * vocab * mc.hidden_size) // par.tp + expert_share


def _routed_expert_parameters(mc) -> int:
    """Every routed expert's weights over the model's MoE layers (0 without moe_config)."""
    m = getattr(mc, "moe_config", None)
    if m is None:
        return 0
    per_layer = m.num_experts * 3 * mc.hidden_size * m.moe_intermediate_size
    return per_layer * len(m.moe_layers(mc.num_hidden_layers))


def _activation_elements_per_token(cfg) -> tuple[int, int]:
    """(saved elements per token of one layer, of one layer's input) on this tp rank: the
    family's count (its row's `activation_elements`)."""
    mc, par = cfg.model.model_config, cfg.parallelism
    sequence_parallel = par.tp_mode == "REDUCE_SCATTER"
    return family_of(mc).activation_elements(mc, par.tp, sequence_parallel)


def _in_flight(cfg) -> int:
    par, m = cfg.parallelism, cfg.tokens.batch_accumulation_per_replica
    return engine(par.pp_engine).in_flight(m, par.pp)


def estimate(cfg) -> MemoryEstimate:
    par, tok, opt = cfg.parallelism, cfg.tokens, cfg.optimizer
    mc = cfg.model.model_config
    elem = DTYPES[cfg.model.dtype].itemsize
    dp_cp = par.dp * par.context_parallel_size
    params = _stage_parameters(cfg)
    zero = opt.zero_stage
    grad_bytes = 4 if opt.accumulate_grad_in_fp32 else elem
    # Muon: one momentum for its matrices, AdamW's two for the rest (counted as two); under
    # ZeRO its step holds two fp32 flat buffers of the stage's matrices (optimizer/muon.py).
    moments = 0 if opt.optimizer_factory.name == "sgd" else 2
    muon_flat = 8 if opt.optimizer_factory.name == "muon" and zero >= 1 and dp_cp > 1 else 0
    master = 1 if elem < 4 else 0
    seq = max(
        [tok.sequence_length] + [s.sequence_length or 0 for s in cfg.data_stages]
    )  # the longest stage
    tokens = tok.micro_batch_size * seq // par.context_parallel_size
    layers = math.ceil(mc.num_hidden_layers / par.pp)
    per_layer, layer_input = _activation_elements_per_token(cfg)
    in_flight = _in_flight(cfg)
    if par.recompute_layer:
        held = in_flight * layers * layer_input + per_layer
    else:
        held = in_flight * layers * per_layer
    vocab_shard = mc.vocab_size // par.tp
    logits = 0 if cfg.model.fused_linear_cross_entropy else 2 * 4 * tokens * vocab_shard
    return MemoryEstimate(
        parameters=params * elem // (dp_cp if zero == 3 else 1),
        gradients=params * grad_bytes // (dp_cp if zero >= 2 else 1),
        optimizer=params * 4 * (moments + master) // (dp_cp if zero >= 1 else 1)
        + params * muon_flat,
        # + one layer's backward working set (gradients of its activations, fp32 norm temps)
        activations=tokens * (held * elem + per_layer * 4),
        logits=logits,
        in_flight=in_flight,
    )


def available_bytes(device: torch.device, world_size: int) -> tuple[int, str]:
    """(bytes this rank may use, where the figure comes from)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    try:
        with open(MEMINFO) as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 2**63, "unknown"  # no figure to check against: not refused
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    share = f", shared by {ranks} ranks on this host" if ranks > 1 else ""
    return kib * 1024 // ranks, f"MemAvailable {kib * 1024 / GIB:.1f} GiB{share}"


def memory_error(cfg, device: torch.device, world_size: int) -> str | None:
    est = estimate(cfg)
    have, where = available_bytes(device, world_size)
    if est.total <= have:
        return None
    tok = cfg.tokens
    return (
        f"not enough memory: this config needs about {est.total / GIB:.1f} GiB per rank "
        f"({est.describe()}; tokens.sequence_length={tok.sequence_length} x "
        f"tokens.micro_batch_size={tok.micro_batch_size}, {est.in_flight} micro-batches in "
        f"flight) but this rank has {have / GIB:.1f} GiB ({where}): lower them, add "
        "parallelism or parallelism.recompute_layer, or set general.ignore_memory_check: true"
    )


def check_memory(cfg, pc) -> None:
    """Collective: every rank raises the same line when one rank's estimate does not fit."""
    if cfg.general.ignore_memory_check:
        return
    error = memory_error(cfg, pc.device, pc.world_size)
    if pc.world_size > 1:
        errors: list[str | None] = [None] * pc.world_size
        dist.all_gather_object(errors, error, group=pc.world_group)
        error = next((e for e in errors if e), None)
    if error:
        raise MemoryCheckError(error)
