"""Context parallel for the Gated DeltaNet mixer: each cp rank mixes its chunks of every
sequence and the delta rule's state crosses ranks, so that the result — forward and backward —
equals one process's.

For the family's block (cp > 1, training), as for Mamba-2 (mixers/mamba2_cp.py):

    reset = local_reset_mask(document_ids, cp_rank, cp)            # or None without documents
    mixed = context_parallel_mix(mixer, hidden, cp_group, reset)   # == mixer.mix(...)[0]
    out = mixer.out_proj(mixed)        # or the block's own row-parallel out_proj under tp

`hidden` is this rank's part [b, L, hidden] (batch-first), its chunks in local order: the
layout attention uses (rank r: chunks r and 2cp-1-r of 2cp; `layout` takes any other
`ChunkLayout`). Under tensor parallel the mixer is the rank's local one (its heads, its conv
channels): cp and tp compose without further communication.

Unlike Mamba-2's, the state's transition is not diagonal: a chunk maps the state S [d_k, d_v]
per value head it starts from to P S + Z, with P [d_k, d_k] a full matrix (the product of the
tokens' a_t (I - beta_t k_t k_t^T)). Per layer, in order (the communication is
nanotron_parallel.context_parallel.state_passing's):
1. in_proj, then the conv's halo: each chunk hands its last K-1 conv inputs (zeroed before its
   last document's start) to the next chunk's owner, p2p (`pass_tails`).
2. conv, then each local chunk's delta rule from a zero state, widened by d_k columns that
   start from the identity (`gated_delta_rule_affine`): its outputs, Z, P, and what the
   initial state will add to each output (P_t^T q_t). Both local chunks in one batched call.
3. ONE all-gather of every chunk's [Z | P] (`gather_summaries`); each rank chains them in
   sequence order (`combine_affine_states`: S_{j+1} = P_j S_j + Z_j) into its chunks' states.
4. o_t += (P_t^T q_t)^T S_start (equal to rescanning from S_start), then the gated norm.
The backward runs the same exchanges reversed (p2p of the halo gradients, a reduce-scatter of
the [Z | P] gradients). The widened scan costs about (d_v + d_k) / d_v times the plain one's
state work, in exchange for no second scan and no sequential ring.

Bytes received per rank and layer, one way (`cp_bytes_per_layer`; e_act the activations'
element size, e_state the scan's: fp32 for bf16/fp32, and a receiving chunk being one of this
rank's whose predecessor is on another rank — 1 or 2 in the zigzag layout):

    halo   = (receiving chunks) * b * (2 H_k d_k + H_v d_v) * (K - 1) * e_act
    states = (cp - 1) * 2 * b * H_v * d_k * (d_v + d_k) * e_state

Independent of the sequence length. Chunks shorter than K-1 tokens are refused
(`check_context_parallel`): a halo would then span several chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanotron_parallel.context_parallel.state_passing import (
    ChunkLayout,
    gather_summaries,
    pass_tails,
)

from .gated_deltanet import GatedDeltaNetDims, GatedDeltaNetMixer
from .gdn_scan import combine_affine_states, gated_delta_rule_affine
from .mamba2_cp import _by_chunk, _by_rank_order, local_reset_mask
from .mamba2_cp import check_context_parallel as check_chunks
from .ssd_scan import Tensor, compute_dtype, conv_halo

__all__ = [
    "CPBytes",
    "check_context_parallel",
    "context_parallel_forward",
    "context_parallel_mix",
    "cp_bytes_per_layer",
    "local_reset_mask",
]


def check_context_parallel(
    dims: GatedDeltaNetDims, seq_len: int, cp: int, chunks_per_rank: int = 2
) -> None:
    """One line when a sequence of `seq_len` cannot be mixed at this cp (Mamba-2's rule: the
    2*cp chunks equal, each at least conv_kernel - 1 tokens)."""
    check_chunks(dims, seq_len, cp, chunks_per_rank, mixer="Gated DeltaNet")


def context_parallel_mix(
    mixer: GatedDeltaNetMixer,
    hidden: Tensor,
    group: dist.ProcessGroup | None,
    reset_mask: Tensor | None = None,
    layout: ChunkLayout | None = None,
    native_reduce_scatter: bool | None = None,
) -> Tensor:
    """`mixer.mix` (everything before out_proj) of this cp rank's chunks: [b, L, hidden] ->
    [b, L, H_v*d_v], equal to the whole sequence's mix at these positions. `reset_mask`
    [b, L] (`local_reset_mask`); `native_reduce_scatter`: the backward's reduce-scatter."""
    cp = dist.get_world_size(group)
    layout = layout or ChunkLayout.zigzag(cp)
    n, (b, length, _) = layout.per_rank, hidden.shape
    d = mixer.dims
    check_context_parallel(d, length * cp, cp, n)
    qkv, z, beta_logit, a = mixer.project(hidden)
    resets = None if reset_mask is None else _by_chunk(reset_mask, n)  # [n*b, C]
    qkv, beta_logit, a = (_by_chunk(t, n) for t in (qkv, beta_logit, a))
    # 1. the halo: what this rank's chunks hand on depends on nothing received
    tails = conv_halo(qkv, d.conv_kernel, resets).unflatten(0, (n, b))
    halos = pass_tails(tails, group, layout).flatten(0, 1)
    act, _ = mixer.conv(qkv, halos, resets)
    # 2. each chunk from a zero state, with its affine map
    inputs = mixer.delta_inputs(act, beta_logit, a)
    o, zero, read, transition = gated_delta_rule_affine(
        *inputs, d.chunk_size, resets, mixer.use_kernels
    )
    # 3. one all-gather of [Z | P], chained in sequence order
    summary = torch.cat((zero, transition), dim=-1).unflatten(0, (n, b))
    every = gather_summaries(summary, group, layout, native_reduce_scatter)
    dv = d.value_head_dim
    starts, _ = combine_affine_states(every[..., :dv], every[..., dv:])
    rank = dist.get_rank(group)
    mine = torch.cat([starts[c] for c in layout.ranks[rank]])  # [n*b, H_v, d_k, d_v]
    # 4. the initial states' share of the outputs (== rescanning from them)
    o = o + torch.einsum("blhk,bhkv->blhv", read, mine)
    return mixer.gate_norm(_by_rank_order(o, n), z).to(hidden.dtype)


def context_parallel_forward(
    mixer: GatedDeltaNetMixer,
    hidden: Tensor,
    group: dist.ProcessGroup | None,
    reset_mask: Tensor | None = None,
    layout: ChunkLayout | None = None,
    native_reduce_scatter: bool | None = None,
) -> Tensor:
    """`mixer(hidden, reset_mask)` of this cp rank's chunks: [b, L, hidden] -> [b, L, hidden]."""
    mixed = context_parallel_mix(mixer, hidden, group, reset_mask, layout, native_reduce_scatter)
    return mixer.out_proj(mixed)


# ---- communication per layer ---------------------------------------------------------------


@dataclass(frozen=True)
class CPBytes:
    """Bytes one cp rank receives per Gated DeltaNet layer and micro-batch, one way. The
    backward moves the same sizes (halo gradients back, a reduce-scatter of the [Z | P]
    gradients)."""

    halo: int  # p2p: (chunks whose neighbour is elsewhere) * b * conv_dim * (K-1) * e_act
    states: int  # all-gather: (cp-1) * chunks_per_rank * b * H_v * d_k * (d_v + d_k) * e_state

    @property
    def total(self) -> int:
        return self.halo + self.states


def cp_bytes_per_layer(
    dims: GatedDeltaNetDims,
    batch: int,
    cp_rank: int,
    cp: int,
    dtype: torch.dtype,
    layout: ChunkLayout | None = None,
    backward: bool = False,
) -> CPBytes:
    """What `context_parallel_mix` receives on `cp_rank` in its forward (or `backward`; dims:
    the tp-local ones; dtype: the activations', the states travel in the scan's compute
    dtype). The backward's reduce-scatter is counted as native (gloo's default, an all-reduce
    and a slice, moves about twice as much)."""
    layout = layout or ChunkLayout.zigzag(cp)
    e_act = torch.empty((), dtype=dtype).element_size()
    e_state = torch.empty((), dtype=compute_dtype(dtype)).element_size()
    halo = batch * dims.conv_dim * (dims.conv_kernel - 1) * e_act
    d_k, d_v = dims.key_head_dim, dims.value_head_dim
    summary = batch * dims.num_value_heads * d_k * (d_v + d_k) * e_state
    return CPBytes(
        halo=len(layout.tails_received(cp_rank, backward)) * halo,
        states=(cp - 1) * layout.per_rank * summary,
    )
