"""The gated delta rule (Gated DeltaNet's recurrence), chunked and token by token, in PyTorch.

Per value head, with the state S [d_k, d_v], a_t = exp(g_t) (g <= 0) and beta_t in (0, 1):

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t

q and k are L2-normalised (q also scaled by d_k^-0.5) before they get here; a key head serves
H_v / H_k consecutive value heads (grouped value attention, as Hugging Face's Qwen3-Next).

`gated_delta_rule` computes it chunk by chunk (the WY / UT form: inside a chunk of C tokens
the delta corrections solve one unit-lower-triangular system, then one recurrence step per
chunk), so the result does not depend on the chunk size beyond rounding. `recurrent_step`
is one token (decoding).

Documents. `reset_mask` [b, l] (True where a token opens a document) zeroes the state before
that token (a_t = 0), so a packed row equals its documents run alone. Inside the chunked form
every decay between two positions of different documents is masked to 0 rather than taking
log(0) (which would make inf - inf).

Context parallel (tensor math only; mixers/gated_deltanet_cp.py does the collectives). The
map from a segment's initial state to its final state is affine, S_end = P S_0 + Z, with P
[d_k, d_k] per head not diagonal; the outputs add (P_t^T q_t)^T S_0. Each column of S evolves
on its own, so ONE scan of the values widened by d_k zero columns, from the initial state
[0 | I], gives all of it (`gated_delta_rule_affine`): Z and P as the final state's two blocks,
and P_t^T q_t as the extra output columns. `combine_affine_states` then chains the segments.

Which runs where: flash-linear-attention's `chunk_gated_delta_rule` (the `fla` package, an
optional install) runs when it is installed, the tensors are on CUDA, `use_kernels` is on and
there is no reset mask; everything else — the CPU always, packed documents, decoding — runs
the PyTorch code below. The CPU test suite exercises only the PyTorch code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanotron_parallel.compile_boundary import eager_under_compile

from .ssd_scan import compute_dtype, documents

try:  # optional CUDA kernels: never a dependency
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
except ImportError:  # pragma: no cover - depends on the environment
    _fla_chunk = None

Tensor = torch.Tensor


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (Hugging Face's and fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@eager_under_compile  # a Python loop over chunks: eager under model.compile (docs/models.md)
def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int,
    initial_state: Tensor | None = None,
    reset_mask: Tensor | None = None,
    use_kernels: bool = True,
) -> tuple[Tensor, Tensor]:
    """o [b, l, H_v, d_v] and the final state [b, H_v, d_k, d_v], in the compute dtype (fp32;
    fp64 for fp64 input). q, k [b, l, H_k, d_k] (normalised, q scaled); v [b, l, H_v, d_v];
    g, beta [b, l, H_v]; initial_state [b, H_v, d_k, d_v]; reset_mask [b, l]."""
    if use_kernels and _fla_chunk is not None and v.is_cuda and reset_mask is None:
        q, k, beta = (t.to(v.dtype) for t in (q, k, beta))  # fla wants one dtype
        # fla runs its own chunks of 64 (the result does not depend on the chunk size)
        o, final = _fla_chunk(
            q, k, v, g.float(), beta, scale=1.0, initial_state=initial_state,
            output_final_state=True,
        )  # fmt: skip
        return o.float(), final.float()
    cdt = compute_dtype(v.dtype)
    rep = v.shape[2] // k.shape[2]
    q, k = (t.to(cdt).repeat_interleave(rep, dim=2) for t in (q, k))
    b, length, h, dv = v.shape
    pad = (-length) % chunk_size
    n = (length + pad) // chunk_size
    # padded steps have g = 0, beta = 0, k = 0: the identity, so the final state is unchanged

    def chunked(x: Tensor) -> Tensor:  # [b, l, h, *] -> [b, h, n, C, *]
        x = F.pad(x.to(cdt), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.view(b, n, chunk_size, h, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    qc, kc, vc = chunked(q), chunked(k), chunked(v)
    gc, bc = chunked(g[..., None])[..., 0], chunked(beta[..., None])[..., 0]
    doc = documents(reset_mask, v)
    if doc is not None:  # padded steps join the last document: they must not break it
        doc = torch.cat((doc, doc[:, -1:].expand(b, pad)), dim=1).view(b, 1, n, chunk_size)
    state = None if initial_state is None else initial_state.to(cdt)
    o, final = _chunked(qc, kc, vc, gc, bc, doc, state)
    o = o.permute(0, 2, 3, 1, 4).reshape(b, n * chunk_size, h, dv)[:, :length]
    return o, final


def _masks(gam: Tensor, doc: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Decays inside each chunk, masked by document: pair [.., C, C] = exp(gam_t - gam_s)
    for s <= t; start [.., C] = exp(gam_t) (chunk start -> t); end [.., C] = exp(gam_C -
    gam_s) (s -> chunk end). gam [b, h, n, C] is the cumulative log decay in each chunk."""
    c = gam.shape[-1]
    keep = torch.ones(c, c, dtype=torch.bool, device=gam.device).tril()
    start_keep = end_keep = None
    if doc is not None:
        keep = keep & (doc[..., :, None] == doc[..., None, :])
        # the document of the token before each chunk (the initial state's: 0 for chunk 0)
        before = F.pad(doc[..., :-1, -1], (1, 0))
        start_keep = doc == before[..., None]
        end_keep = doc == doc[..., -1:]
    diff = (gam[..., :, None] - gam[..., None, :]).masked_fill(~keep, float("-inf"))
    start = gam.exp()
    end = (gam[..., -1:] - gam).exp()
    if doc is not None:
        start, end = start * start_keep, end * end_keep
    return diff.exp(), start, end


def _chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc: Tensor | None,
    state: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The WY form. q, k [b, h, n, C, d_k], v [b, h, n, C, d_v], g, beta [b, h, n, C],
    doc [b, 1, n, C] or None, state [b, h, d_k, d_v] or None -> o [b, h, n, C, d_v], final."""
    b, h, n, c, dk = k.shape
    gam = g.cumsum(dim=-1)
    pair, start, end = _masks(gam, doc)
    kb = k * beta[..., None]
    # delta_t = beta_t (v_t - a_t S_{t-1}^T k_t) for every t of a chunk at once: (I + A) delta =
    # beta V - beta exp(gam) K S_0, A strictly lower (A_ts = beta_t exp(gam_t - gam_s) k_t.k_s)
    system = (kb @ k.transpose(-1, -2)) * pair
    eye = torch.eye(c, dtype=k.dtype, device=k.device)
    system = system.tril(-1) + eye
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * start[..., None], upper=False,
                                      unitriangular=True)  # fmt: skip
    attn = (q @ k.transpose(-1, -2)) * pair  # o_t reads delta_s for s <= t (diagonal included)
    q_start = q * start[..., None]
    k_end = k * end[..., None]
    carry = start[..., -1]  # exp(gam_C): 0 when the chunk opens a document anywhere
    if state is None:
        state = k.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for i in range(n):
        delta = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_start[:, :, i] @ state + attn[:, :, i] @ delta)
        state = state * carry[:, :, i, None, None] + k_end[:, :, i].transpose(-1, -2) @ delta
    return torch.stack(outs, dim=2), state


def recurrent_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One token: q, k [b, H_k, d_k], v [b, H_v, d_v], g, beta [b, H_v], state [b, H_v, d_k,
    d_v] -> (o [b, H_v, d_v], the new state), in the state's dtype (the input is not modified)."""
    cdt = state.dtype
    rep = v.shape[1] // k.shape[1]
    q, k = (t.to(cdt).repeat_interleave(rep, dim=1) for t in (q, k))
    decayed = state * g.to(cdt).exp()[..., None, None]
    predicted = (decayed * k[..., None]).sum(dim=-2)  # S^T k: [b, h, d_v]
    delta = (v.to(cdt) - predicted) * beta.to(cdt)[..., None]
    new = decayed + k[..., None] * delta[..., None, :]
    return (new * q[..., None]).sum(dim=-2), new


# ---- context parallel: the affine map of a segment ------------------------------------------


def gated_delta_rule_affine(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int,
    reset_mask: Tensor | None = None, use_kernels: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """A segment's outputs and final state from a zero state, and how both depend on the
    initial state S_0: (o [b, l, H_v, d_v], Z [b, H_v, d_k, d_v], read [b, l, H_v, d_k],
    P [b, H_v, d_k, d_k]) with, from S_0, o_t + read_t S_0 and P S_0 + Z."""
    dk, dv = k.shape[-1], v.shape[-1]
    b, h = v.shape[0], v.shape[2]
    cdt = compute_dtype(v.dtype)
    wide = torch.cat((v.to(cdt), v.new_zeros(*v.shape[:-1], dk, dtype=cdt)), dim=-1)
    eye = torch.eye(dk, dtype=cdt, device=v.device).expand(b, h, dk, dk)
    start = torch.cat((eye.new_zeros(b, h, dk, dv), eye), dim=-1)
    o, final = gated_delta_rule(q, k, wide, g, beta, chunk_size, start, reset_mask, use_kernels)
    return o[..., :dv], final[..., :dv], o[..., dv:], final[..., dv:]


def combine_affine_states(
    zero_states: Tensor, transitions: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Each segment's initial state from every segment's (Z [S, b, h, d_k, d_v], P [S, b, h,
    d_k, d_k]) in sequence order: start_0 = initial_state (or 0), start_{j+1} = P_j start_j +
    Z_j. Returns ([S, b, h, d_k, d_v] initial states, the state after the last segment)."""
    state = torch.zeros_like(zero_states[0]) if initial_state is None else initial_state
    state = state.to(zero_states.dtype)
    starts = []
    for z, p in zip(zero_states, transitions):
        starts.append(state)
        state = p @ state + z
    return torch.stack(starts), state
