"""Context parallel for the Mamba-2 mixer: each cp rank mixes its chunks of every sequence and
the state crosses ranks, so that the result — forward and backward — equals one process's.

For the family's block (cp > 1, training):

    reset = local_reset_mask(document_ids, cp_rank, cp)      # or None without documents
    mixed = context_parallel_mix(mixer, hidden, cp_group, reset)   # == mixer.mix(...)[0]
    out = mixer.out_proj(mixed)        # or the block's own row-parallel out_proj under tp

`hidden` is this rank's part [b, L, hidden] (batch-first, as the mixer), its chunks in local
order: the layout attention uses (rank r: chunks r and 2cp-1-r of 2cp; `layout` takes any
other `ChunkLayout`). `document_ids` is the whole sequence's [b, S] (the batch keeps it
whole); `reset` [b, L] then marks every document start, those at a chunk's first token
included. Under tensor parallel the mixer is the rank's local one and everything here is per
tp rank (local heads and conv channels); cp and tp compose without further communication.

Per layer, in order (nanotron_parallel.context_parallel.state_passing does the communication):
1. in_proj, then the conv's halo: each chunk hands its last K-1 conv inputs (zeroed before
   its last document's start: `conv_halo`) to the next chunk's owner, p2p (`pass_tails`).
2. conv, then the SSD scan of each chunk from a zero state (both local chunks in one batched
   call): its outputs, its final state and its total decay (`ssd_total_decay`).
3. ONE all-gather of every chunk's (state, decay) (`gather_summaries`); each rank combines
   them in sequence order (`combine_segment_states`) into its chunks' initial states.
4. what that initial state adds to the outputs (`ssd_initial_state_output`: the scan is
   linear in it, so this equals rescanning), then the gated norm.
The backward runs the same exchanges reversed: p2p of the halo gradients, a reduce-scatter of
the (state, decay) gradients. Bytes received per rank and layer: `cp_bytes_per_layer`
(docs/parallelism.md, "State-space layers"). Chunks shorter than K-1 tokens are refused
(`check_context_parallel`): a halo then spans several chunks.
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
from nanotron_parallel.grid import ParallelConfigError

from .mamba2 import Mamba2Dims, Mamba2Mixer
from .ssd_scan import (
    Tensor,
    combine_segment_states,
    compute_dtype,
    conv_halo,
    reset_mask_from_document_ids,
    ssd_initial_state_output,
    ssd_scan,
    ssd_total_decay,
)


def check_context_parallel(
    dims: Mamba2Dims, seq_len: int, cp: int, chunks_per_rank: int = 2, mixer: str = "Mamba-2"
):
    """One line when a sequence of `seq_len` cannot be mixed at this cp: the 2*cp chunks must
    be equal and each at least conv_kernel - 1 tokens (the halo comes from one chunk). Any
    mixer with a causal conv (`dims.conv_kernel`), named `mixer` in the message."""
    chunks = cp * chunks_per_rank
    if seq_len % chunks:
        raise ParallelConfigError(
            f"{mixer} context parallel: sequence length {seq_len} is not divisible by the "
            f"{chunks} chunks of cp={cp}"
        )
    if seq_len // chunks < dims.conv_kernel - 1:
        raise ParallelConfigError(
            f"{mixer} context parallel: chunks of {seq_len // chunks} tokens (sequence length "
            f"{seq_len} in {chunks} chunks at cp={cp}) are shorter than conv_kernel - 1 = "
            f"{dims.conv_kernel - 1}: use a longer sequence or a smaller cp"
        )


def local_reset_mask(
    document_ids: Tensor, cp_rank: int, cp: int, layout: ChunkLayout | None = None
) -> Tensor:
    """This rank's [b, L] resets from the whole sequence's [b, S] document ids: a token resets
    where its document differs from the token before it in the sequence (across chunks)."""
    layout = layout or ChunkLayout.zigzag(cp)
    return layout.split(reset_mask_from_document_ids(document_ids), 1, cp_rank)


def context_parallel_mix(
    mixer: Mamba2Mixer,
    hidden: Tensor,
    group: dist.ProcessGroup | None,
    reset_mask: Tensor | None = None,
    layout: ChunkLayout | None = None,
    native_reduce_scatter: bool | None = None,
) -> Tensor:
    """`mixer.mix` (everything before out_proj) of this cp rank's chunks: [b, L, hidden] ->
    [b, L, I], equal to the whole sequence's mix at these positions. `reset_mask` [b, L]
    (`local_reset_mask`); `native_reduce_scatter`: the backward's reduce-scatter (see
    tensor_parallel.functional.native_reduce_scatter)."""
    cp = dist.get_world_size(group)
    layout = layout or ChunkLayout.zigzag(cp)
    n, (b, length, _) = layout.per_rank, hidden.shape
    check_context_parallel(mixer.dims, length * cp, cp, n)
    k = mixer.dims.conv_kernel
    z, xbc, dt = mixer.project(hidden)
    resets = None if reset_mask is None else _by_chunk(reset_mask, n)  # [n*b, C]
    xbc, dt = _by_chunk(xbc, n), _by_chunk(dt, n)
    # 1. the halo: what this rank's chunks hand on depends on nothing received
    tails = conv_halo(xbc, k, resets).unflatten(0, (n, b))
    halos = pass_tails(tails, group, layout).flatten(0, 1)
    act, _ = mixer.conv(xbc, halos, resets)
    # 2. each chunk from a zero state
    x, dts, A, B, C = mixer.ssm_inputs(act, dt)
    y, state = ssd_scan(
        x, dts, A, B, C, mixer.dims.chunk_size, D=mixer.D, reset_mask=resets,
        use_kernels=mixer.use_kernels,
    )  # fmt: skip
    decay = ssd_total_decay(dts, A, resets)
    # 3. one all-gather of (state, decay), combined in sequence order
    summary = torch.cat((state.flatten(-2), decay[..., None].to(state.dtype)), dim=-1)
    every = gather_summaries(summary.unflatten(0, (n, b)), group, layout, native_reduce_scatter)
    starts, _ = combine_segment_states(
        every[..., :-1].unflatten(-1, state.shape[-2:]), every[..., -1]
    )
    rank = dist.get_rank(group)
    mine = torch.cat([starts[c] for c in layout.ranks[rank]])  # [n*b, H, P, N], chunk-major
    # 4. the initial states' share of the outputs (== rescanning from them)
    y = y + ssd_initial_state_output(C, dts, A, mine, resets)
    return mixer.gate_norm(_by_rank_order(y, n), z).to(hidden.dtype)


def context_parallel_forward(
    mixer: Mamba2Mixer,
    hidden: Tensor,
    group: dist.ProcessGroup | None,
    reset_mask: Tensor | None = None,
    layout: ChunkLayout | None = None,
    native_reduce_scatter: bool | None = None,
) -> Tensor:
    """`mixer(hidden, reset_mask)` of this cp rank's chunks: [b, L, hidden] -> [b, L, hidden]."""
    mixed = context_parallel_mix(mixer, hidden, group, reset_mask, layout, native_reduce_scatter)
    return mixer.out_proj(mixed)


def _by_chunk(x: Tensor, n: int) -> Tensor:
    """[b, n*C, ...] -> [n*b, C, ...]: the local chunks stacked on the batch (chunk-major), so
    that one conv and one scan call runs them all, each as its own segment."""
    return torch.cat(x.chunk(n, dim=1), dim=0)


def _by_rank_order(x: Tensor, n: int) -> Tensor:
    """The inverse of `_by_chunk`: [n*b, C, ...] -> [b, n*C, ...]."""
    return torch.cat(x.chunk(n, dim=0), dim=1)


# ---- communication per layer ---------------------------------------------------------------


@dataclass(frozen=True)
class CPBytes:
    """Bytes one cp rank receives per Mamba-2 layer and micro-batch, one way. The backward
    moves the same sizes (halo gradients back, a reduce-scatter of the (state, decay)
    gradients); in the zigzag layout every rank receives as much each way."""

    halo: int  # p2p: (chunks whose neighbour is elsewhere) * b * conv_dim * (K-1) * e_act
    states: int  # all-gather: (cp-1) * chunks_per_rank * b * H * (P*N + 1) * e_state

    @property
    def total(self) -> int:
        return self.halo + self.states


def cp_bytes_per_layer(
    dims: Mamba2Dims,
    batch: int,
    cp_rank: int,
    cp: int,
    dtype: torch.dtype,
    layout: ChunkLayout | None = None,
    backward: bool = False,
) -> CPBytes:
    """What `context_parallel_mix` receives on `cp_rank` in its forward (or `backward`; dims:
    the tp-local ones; dtype: the activations', the states travel in the scan's compute
    dtype). Independent of the sequence length: a halo is K-1 positions, a state one per
    chunk. The backward's reduce-scatter is counted as native (gloo's default, an all-reduce
    and a slice, moves about twice as much)."""
    layout = layout or ChunkLayout.zigzag(cp)
    e_act = torch.empty((), dtype=dtype).element_size()
    e_state = torch.empty((), dtype=compute_dtype(dtype)).element_size()
    halo = batch * dims.conv_dim * (dims.conv_kernel - 1) * e_act
    summary = batch * dims.num_heads * (dims.head_dim * dims.state_size + 1) * e_state
    return CPBytes(
        halo=len(layout.tails_received(cp_rank, backward)) * halo,
        states=(cp - 1) * layout.per_rank * summary,
    )
