"""The Mamba-2 state-space duality (SSD) scan and its depthwise causal conv, in plain PyTorch.

The recurrence, per head h (state [head_dim, state_size]), with a_t = exp(dt_t * A_h):

    state_t = a_t * state_{t-1} + dt_t * x_t B_t^T        y_t = state_t C_t (+ D_h x_t)

`ssd_scan` computes it chunk by chunk (quadratic inside a chunk of `chunk_size`, a recurrence
over chunk boundaries), so the result does not depend on the chunk size beyond rounding.

Documents. `reset_mask` [b, l] (True where a token opens a document) zeroes the state before
that token: a packed row equals its documents scanned alone. Internally a token's document is
the count of resets up to it; the initial state (and the conv's halo) belongs to document 0,
the one a row continues unless its first token resets. Every decay between two positions of
different documents is masked to 0, which is also what mamba_ssm's `seq_idx` means.

Context parallel (pure tensor math here; the collectives belong to the caller). A segment's
output is linear in its initial state, so the two-pass form is: each segment scans from zero
(`ssd_scan`, giving its state from zero) and reports `ssd_total_decay`; `combine_segment_states`
turns the gathered (state_from_zero, total_decay) pairs, in sequence order, into each
segment's initial state; `ssd_initial_state_output` is then what that initial state adds to
the segment's output (equal to rescanning from it, at the cost of one cumsum and one einsum).
The conv's halo is the previous segment's last conv_kernel - 1 inputs (`causal_conv`).

Which runs where: mamba_ssm's `mamba_chunk_scan_combined` and causal_conv1d's
`causal_conv1d_fn` run when installed and the tensors are on CUDA (and the call is one they
support); everything else, the CPU always, runs the PyTorch code below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanotron_parallel.compile_boundary import eager_under_compile

try:  # optional CUDA kernels: never a dependency
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
except ImportError:  # pragma: no cover - depends on the environment
    mamba_chunk_scan_combined = None
try:
    from causal_conv1d import causal_conv1d_fn
except ImportError:  # pragma: no cover - depends on the environment
    causal_conv1d_fn = None

Tensor = torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The scan's arithmetic: fp32 for half types and fp32, fp64 kept (the tests' reference)."""
    return torch.promote_types(dtype, torch.float32)


def documents(reset_mask: Tensor | None, like: Tensor) -> Tensor | None:
    """[b, l] document index of each token (0 = the one the initial state belongs to)."""
    if reset_mask is None:
        return None
    return reset_mask.to(device=like.device, dtype=torch.long).cumsum(dim=1)


def reset_mask_from_document_ids(
    document_ids: Tensor, previous_ids: Tensor | None = None
) -> Tensor:
    """[b, l] resets from document ids (e.g. masks.document_ids of the position ids).

    A token resets when its id differs from the previous token's. The first token compares
    with `previous_ids` [b] (the last id of the previous segment, for context parallel); with
    none it continues, which is the same as resetting when no initial state is passed.
    """
    reset = torch.zeros_like(document_ids, dtype=torch.bool)
    reset[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    if previous_ids is not None:
        reset[:, 0] = document_ids[:, 0] != previous_ids
    return reset


# ---- the depthwise causal conv ---------------------------------------------------------------


def causal_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    halo: Tensor | None = None,
    reset_mask: Tensor | None = None,
    use_kernels: bool = True,
) -> tuple[Tensor, Tensor]:
    """SiLU(depthwise causal conv) of x [b, l, c] with weight [c, K]; returns (y [b, l, c],
    the next halo [b, c, K-1]).

    `halo` [b, c, K-1] is the previous segment's last K-1 inputs (zeros when None: a sequence
    start). A tap never reads across a document boundary (`reset_mask`); the returned halo keeps
    only the inputs of the last document, so it is right to hand to the next segment.
    """
    b, length, c = x.shape
    k = weight.shape[-1]
    if halo is None and reset_mask is None and length >= k - 1 and _conv_kernel_ok(x, use_kernels):
        y = causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu")
        return y.transpose(1, 2), _final_halo(x.transpose(1, 2), k, None)
    if halo is None:
        halo = x.new_zeros(b, c, k - 1)
    full = torch.cat((halo.to(x.dtype), x.transpose(1, 2)), dim=2)  # [b, c, K-1+l]
    doc = documents(reset_mask, x)
    if doc is None:
        y = F.conv1d(full.to(weight.dtype), weight[:, None, :], bias, groups=c)
    else:
        # same as the conv, with each tap zeroed where it would read another document
        doc_full = F.pad(doc, (k - 1, 0))  # the halo is document 0
        y = 0
        for lag in range(k):  # tap `lag` reads position t - lag
            start = k - 1 - lag
            same = (doc_full[:, start : start + length] == doc)[:, None, :]
            y = y + full[:, :, start : start + length] * same * weight[:, k - 1 - lag, None]
        if bias is not None:
            y = y + bias[:, None]
    y = F.silu(y).to(x.dtype).transpose(1, 2)
    return y, _final_halo(full, k, None if doc is None else F.pad(doc, (k - 1, 0)))


def conv_halo(x: Tensor, kernel: int, reset_mask: Tensor | None = None) -> Tensor:
    """The halo [b, c, K-1] a segment x [b, l, c] (l >= K-1) hands to the next one: its last
    K-1 conv inputs, zeroed before its last document's start. A context-parallel rank can send
    it before running its own conv (it depends on nothing received)."""
    if x.shape[1] < kernel - 1:
        raise ValueError(f"conv_halo: a segment of {x.shape[1]} tokens < conv_kernel - 1")
    doc = documents(reset_mask, x)
    return _final_halo(x.transpose(1, 2), kernel, doc)


def _final_halo(full: Tensor, k: int, doc_full: Tensor | None) -> Tensor:
    """The last K-1 inputs of [b, c, *] `full`, zeroed where not of the last document."""
    halo = full[:, :, full.shape[2] - (k - 1) :]
    if doc_full is not None:
        tail = doc_full[:, doc_full.shape[1] - (k - 1) :]
        halo = halo * (tail == doc_full[:, -1:])[:, None, :]
    return halo


def _conv_kernel_ok(x: Tensor, use_kernels: bool) -> bool:
    return use_kernels and causal_conv1d_fn is not None and x.is_cuda


# ---- the chunked scan ------------------------------------------------------------------------


@eager_under_compile  # the chunked scan stays eager under model.compile (docs/models.md)
def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    reset_mask: Tensor | None = None,
    use_kernels: bool = True,
) -> tuple[Tensor, Tensor]:
    """y [b, l, h, p] and the final state [b, h, p, n], both fp32 (fp64 for fp64 input; y is
    left there because the gated norm that follows works in fp32, as in Hugging Face; the
    CUDA kernel returns y in x's dtype).

    x [b, l, h, p]; dt [b, l, h] (the step, after softplus and clamp); A [h] (negative);
    B, C [b, l, g, n] with h a multiple of g (head i reads group i // (h // g)); D [h];
    initial_state [b, h, p, n]; reset_mask [b, l] (see the module docstring).
    """
    if use_kernels and mamba_chunk_scan_combined is not None and x.is_cuda:
        doc = documents(reset_mask, x)
        y, final = mamba_chunk_scan_combined(
            x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state,
            seq_idx=None if doc is None else doc.to(torch.int32), return_final_states=True,
        )  # fmt: skip
        return y, final
    cdt = compute_dtype(x.dtype)
    b, length, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    q = chunk_size
    pad = (-length) % q
    nc = (length + pad) // q
    # padded steps have dt = 0: decay 1, no input, so the final state is unchanged by them
    dt = F.pad(dt.to(cdt), (0, 0, 0, pad))
    xdt = F.pad(x.to(cdt), (0, 0, 0, 0, 0, pad)) * dt[..., None]
    dA = (dt * A.to(cdt)).view(b, nc, q, g, h // g).permute(0, 3, 4, 1, 2)  # [b, g, r, c, q]
    xdt = xdt.view(b, nc, q, g, h // g, p)
    Bc = F.pad(B.to(cdt), (0, 0, 0, 0, 0, pad)).view(b, nc, q, g, n)
    Cc = F.pad(C.to(cdt), (0, 0, 0, 0, 0, pad)).view(b, nc, q, g, n)
    doc = documents(reset_mask, x)
    if doc is not None:  # padded steps join the last document: they must not break it
        doc = torch.cat((doc, doc[:, -1:].expand(b, pad)), dim=1)
    init = None if initial_state is None else initial_state.to(cdt).reshape(b, g, h // g, p, n)
    y, final = _chunked(xdt, dA, Bc, Cc, doc, init)
    y = y.reshape(b, nc * q, h, p)[:, :length]
    if D is not None:
        y = y + x.to(cdt) * D.to(cdt)[:, None]
    return y, final.reshape(b, h, p, n)


def _chunked(
    xdt: Tensor, dA: Tensor, B: Tensor, C: Tensor, doc: Tensor | None, init: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The SSD block decomposition. xdt [b, c, q, g, r, p] (x * dt), dA [b, g, r, c, q],
    B, C [b, c, q, g, n], doc [b, c*q] or None, init [b, g, r, p, n] or None."""
    b, nc, q, g, r, p = xdt.shape
    doc_c = None if doc is None else doc.view(b, nc, q)
    # 1. inside each chunk: a decay-masked "attention" C_l B_s^T over positions s <= l
    same = None if doc_c is None else doc_c[:, :, :, None] == doc_c[:, :, None, :]
    decay = torch.exp(_segment_sum(dA, None if same is None else same[:, None, None]))
    scores = torch.einsum("bclgn,bcsgn->bgcls", C, B)[:, :, None] * decay  # [b,g,r,c,l,s]
    y_diag = torch.einsum("bgrcls,bcsgrp->bclgrp", scores, xdt)
    # 2. each chunk's own contribution to the state at its end: the last row of `decay`
    chunk_states = torch.einsum("bcsgn,bgrcs,bcsgrp->bcgrpn", B, decay[..., -1, :], xdt)
    # 3. the states at chunk boundaries 0..nc (0: the initial state, document 0)
    if init is None:
        init = chunk_states.new_zeros(chunk_states[:, 0].shape)
    totals = F.pad(dA.sum(dim=-1), (1, 0))  # [b, g, r, 1+c]: boundary k-1 -> k
    bound_doc = None if doc_c is None else F.pad(doc_c[:, :, -1], (1, 0))  # [b, 1+c]
    same_b = None if bound_doc is None else bound_doc[:, :, None] == bound_doc[:, None, :]
    carry = torch.exp(_segment_sum(totals, None if same_b is None else same_b[:, None, None]))
    states = torch.cat((init[:, None], chunk_states), dim=1)  # [b, 1+c, g, r, p, n]
    states = torch.einsum("bgrkz,bzgrpn->bkgrpn", carry, states)
    entering, final = states[:, :-1], states[:, -1]
    # 4. what the state entering each chunk adds to its outputs
    into = torch.exp(torch.cumsum(dA, dim=-1))  # [b, g, r, c, l]: chunk start -> l inclusive
    if doc_c is not None:
        into = into * (doc_c == bound_doc[:, :-1, None])[:, None, None]
    y_off = torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", C, entering, into)
    return y_diag + y_off, final


def _segment_sum(a: Tensor, same: Tensor | None) -> Tensor:
    """[..., T] -> [..., T, T]: out[i, j] = a[j+1] + ... + a[i] for j <= i (and `same[i, j]`),
    -inf elsewhere. Summed directly rather than as cumsum differences, which lose precision
    when the cumulative sums are large."""
    t = a.shape[-1]
    strict = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., :, None].expand(*a.shape, t).masked_fill(~strict, 0).cumsum(dim=-2)
    keep = torch.ones(t, t, dtype=torch.bool, device=a.device).tril()
    if same is not None:
        keep = keep & same
    return sums.masked_fill(~keep, float("-inf"))


# ---- the pieces a two-pass context parallel needs ------------------------------------------


def ssd_total_decay(dt: Tensor, A: Tensor, reset_mask: Tensor | None = None) -> Tensor:
    """[b, h]: the factor a segment applies to the state it starts from (exp of the summed
    dt * A; 0 when the segment resets anywhere, since no later token sees the old state)."""
    cdt = compute_dtype(dt.dtype)
    decay = torch.exp((dt.to(cdt) * A.to(cdt)).sum(dim=1))
    if reset_mask is not None:
        decay = decay * (~reset_mask.any(dim=1, keepdim=True)).to(cdt)
    return decay


def combine_segment_states(
    states_from_zero: Tensor, total_decays: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Each segment's initial state from every segment's (state from zero, total decay).

    states_from_zero [S, b, h, p, n] and total_decays [S, b, h], in sequence order (with the
    zigzag layout: the chunks' order in the sequence, not the ranks'). Returns ([S, b, h, p, n]
    initial states, the state after the last segment). `initial_state` is the sequence's own.
    """
    state = torch.zeros_like(states_from_zero[0]) if initial_state is None else initial_state
    state = state.to(states_from_zero.dtype)
    starts = []
    for seg_state, seg_decay in zip(states_from_zero, total_decays):
        starts.append(state)
        state = seg_decay[..., None, None] * state + seg_state
    return torch.stack(starts), state


def ssd_initial_state_output(
    C: Tensor, dt: Tensor, A: Tensor, initial_state: Tensor, reset_mask: Tensor | None = None
) -> Tensor:
    """[b, l, h, p] (fp32/fp64): what `initial_state` adds to a segment's output (the scan is linear in it):
    y_t += (prod of a_1..a_t) * initial_state C_t, for the tokens before the first reset."""
    cdt = compute_dtype(C.dtype)
    b, length, g, n = C.shape
    h = A.shape[0]
    decay = torch.exp(torch.cumsum(dt.to(cdt) * A.to(cdt), dim=1))  # [b, l, h]
    doc = documents(reset_mask, C)
    if doc is not None:
        decay = decay * (doc == 0)[:, :, None]
    state = initial_state.to(cdt).reshape(b, g, h // g, -1, n)
    y = torch.einsum("blgn,bgrpn->blgrp", C.to(cdt), state)
    return y.reshape(b, length, h, -1) * decay[..., None]
