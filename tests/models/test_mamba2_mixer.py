"""The Mamba-2 mixer (nanotron_models.mixers): values against transformers' Mamba2Mixer and an
fp64 token-by-token recurrence written here; chunk-size independence, segment continuation
(state + conv halo), the context-parallel combine, packed documents (values and gradients),
decoding steps, and the tensor-parallel shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanotron_models.mixers import (
    Mamba2Dims,
    Mamba2Mixer,
    Mamba2State,
    combine_segment_states,
    conv_halo,
    reset_mask_from_document_ids,
    shard_mamba2,
    ssd_initial_state_output,
    ssd_scan,
    ssd_total_decay,
    unshard_mamba2,
)

DIMS = Mamba2Dims(
    hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16, conv_kernel=4,
    chunk_size=8,
)  # fmt: skip
F64 = torch.float64


def randomise_(mixer: Mamba2Mixer, seed: int = 0) -> Mamba2Mixer:
    """Every parameter random (A_log, D, dt_bias and the norm included), in a sane range."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=F64)
            if name == "A_log":
                r = r.clamp(-2, 2) * 0.7
            elif name == "dt_bias":
                r = r - 1.0
            elif name == "norm.weight":
                r = 1 + 0.3 * r
            elif p.ndim > 1:
                r = r / p[0].numel() ** 0.5
            p.copy_(r)
    return mixer


def make(dims: Mamba2Dims = DIMS, dtype=F64, seed: int = 0) -> Mamba2Mixer:
    return randomise_(Mamba2Mixer(dims, dtype=dtype), seed)


def naive(mx: Mamba2Mixer, hidden: torch.Tensor, reset: torch.Tensor | None = None):
    """The mixer one token at a time, from its definition (not from the module's code)."""
    d = mx.dims
    b, length, _ = hidden.shape
    reset = torch.zeros(b, length, dtype=torch.bool) if reset is None else reset
    zxbcdt = F.linear(hidden, mx.in_proj.weight, mx.in_proj.bias)
    i, gn, k = d.intermediate_size, d.n_groups * d.state_size, d.conv_kernel
    z, xbc, dt = zxbcdt.split([i, d.conv_dim, d.num_heads], -1)
    doc = reset.long().cumsum(1)
    w = mx.conv1d.weight[:, 0]
    conv = []
    for t in range(length):
        acc = mx.conv1d.bias.expand(b, -1) if mx.conv1d.bias is not None else 0
        for lag in range(k):
            if t - lag >= 0:
                same = (doc[:, t - lag] == doc[:, t])[:, None]
                acc = acc + w[:, k - 1 - lag] * xbc[:, t - lag] * same
        conv.append(F.silu(acc))
    xbc = torch.stack(conv, 1)
    x, B, C = xbc.split([i, gn, gn], -1)
    dt = F.softplus(dt + mx.dt_bias).clamp(*d.time_step_limit)
    A = -torch.exp(mx.A_log)
    per = d.num_heads // d.n_groups
    h = hidden.new_zeros(b, d.num_heads, d.head_dim, d.state_size)
    ys = []
    for t in range(length):
        h = h * (~reset[:, t])[:, None, None, None]
        xt = x[:, t].view(b, d.num_heads, d.head_dim)
        Bt = B[:, t].view(b, d.n_groups, 1, d.state_size).expand(-1, -1, per, -1).flatten(1, 2)
        Ct = C[:, t].view(b, d.n_groups, 1, d.state_size).expand(-1, -1, per, -1).flatten(1, 2)
        a = torch.exp(dt[:, t] * A)[:, :, None, None]
        h = a * h + dt[:, t, :, None, None] * xt[..., None] * Bt[:, :, None, :]
        ys.append((h * Ct[:, :, None, :]).sum(-1) + mx.D[:, None] * xt)
    y = torch.stack(ys, 1).flatten(2) * F.silu(z)
    g = y.unflatten(-1, (d.n_groups, -1))
    y = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + d.norm_eps)).flatten(2)
    return F.linear(mx.norm.weight * y, mx.out_proj.weight, mx.out_proj.bias)


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= rel, f"relative error {err:.3g} > {rel}"


# ---- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "use_bias,limit", [(False, (0.0, float("inf"))), (True, (0.02, 0.4))], ids=["plain", "bias"]
)
def test_matches_transformers(use_bias, limit):
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer

    cfg = Mamba2Config(
        hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16, conv_kernel=4,
        chunk_size=8, expand=2, use_bias=use_bias, time_step_limit=limit, num_hidden_layers=1,
    )  # fmt: skip
    ours = make(Mamba2Dims.from_hf(cfg), dtype=torch.float32)
    hf = HFMixer(cfg, layer_idx=0).eval()
    assert {k: v.shape for k, v in hf.state_dict().items()} == {
        k: v.shape for k, v in ours.state_dict().items()
    }
    hf.load_state_dict(ours.state_dict())
    x = torch.randn(2, 21, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(ours(x), hf(x), 1e-5)


def test_fp64_matches_recurrence_and_chunk_sizes_agree():
    mx = make()
    x = torch.randn(2, 37, 64, dtype=F64)
    with torch.no_grad():
        ref = naive(mx, x)
        close(mx(x), ref, 1e-11)
        for q in (5, 64):
            close(Mamba2Mixer.forward(_with_chunk(mx, q), x), ref, 1e-11)
    fp32 = make(dtype=torch.float32)
    x32 = x.float()
    with torch.no_grad():
        a = fp32(x32)
        close(_with_chunk(fp32, 64)(x32), a, 1e-5)


def _with_chunk(mx: Mamba2Mixer, chunk: int) -> Mamba2Mixer:
    other = Mamba2Mixer(
        Mamba2Dims(**{**mx.dims.__dict__, "chunk_size": chunk}), dtype=mx.in_proj.weight.dtype
    )
    other.load_state_dict(mx.state_dict())
    return other


def test_gradients_match_recurrence():
    mx = make(Mamba2Dims(32, 4, 8, 2, 4, conv_kernel=3, chunk_size=4))
    x = torch.randn(2, 11, 32, dtype=F64, requires_grad=True)
    w = torch.randn(2, 11, 32, dtype=F64)
    reset = torch.zeros(2, 11, dtype=torch.bool)
    reset[0, 6] = True
    params = [x, *mx.parameters()]
    ours = torch.autograd.grad((mx(x, reset) * w).sum(), params)
    ref = torch.autograd.grad((naive(mx, x, reset) * w).sum(), params)
    for a, b in zip(ours, ref):
        close(a, b, 1e-10)


def test_scan_gradients_with_initial_state():
    """ssd_scan's y and final state, and their gradients wrt every input (the initial state
    included: context parallel's backward goes through it), against the plain recurrence."""
    g = torch.Generator().manual_seed(5)
    b, length, h, p, gr, n = 2, 13, 4, 3, 2, 5
    x = torch.randn(b, length, h, p, generator=g, dtype=F64)
    dt = F.softplus(torch.randn(b, length, h, generator=g, dtype=F64))
    A = -torch.rand(h, generator=g, dtype=F64) - 0.1
    B, C = torch.randn(2, b, length, gr, n, generator=g, dtype=F64)
    D = torch.randn(h, generator=g, dtype=F64)
    h0 = torch.randn(b, h, p, n, generator=g, dtype=F64)
    inputs = [t.requires_grad_() for t in (x, dt, A, B, C, D, h0)]
    wy, wf = torch.randn(b, length, h, p, dtype=F64), torch.randn(b, h, p, n, dtype=F64)
    y, final = ssd_scan(x, dt, A, B, C, 4, D, h0)
    ours = torch.autograd.grad((y * wy).sum() + (final * wf).sum(), inputs)
    state, ys = h0, []
    Bh, Ch = (t.repeat_interleave(h // gr, dim=2) for t in (B, C))
    for t in range(length):
        state = torch.exp(dt[:, t] * A)[..., None, None] * state
        state = state + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((state * Ch[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    close(y, torch.stack(ys, 1), 1e-12)
    close(final, state, 1e-12)
    ref = torch.autograd.grad((torch.stack(ys, 1) * wy).sum() + (state * wf).sum(), inputs)
    for a, r in zip(ours, ref):
        close(a, r, 1e-11)


# ---- segments: continuation, context parallel -----------------------------------------------


def test_continuation_from_state_and_halo():
    """[a; b] in one call equals a, then b from a's final state (SSM state + conv halo), for
    splits inside a chunk, a b shorter than the conv's halo, and documents: one starting
    inside a's last K-1 tokens (the halo must not carry the document before it), one
    starting exactly at a cut."""
    mx = make()
    x = torch.randn(2, 30, 64, dtype=F64)
    reset = torch.zeros(2, 30, dtype=torch.bool)
    reset[0, [11, 20]] = True
    reset[1, 8] = True
    with torch.no_grad():
        full, full_state = mx(x, reset, return_state=True)
        close(full, naive(mx, x, reset), 1e-11)
        for cuts in ([13], [8, 10, 12], [29]):
            state, outs = None, []
            for lo, hi in zip([0, *cuts], [*cuts, 30]):
                out, state = mx(x[:, lo:hi], reset[:, lo:hi], state, return_state=True)
                outs.append(out)
            close(torch.cat(outs, 1), full, 1e-12)
            close(state.ssm, full_state.ssm, 1e-12)
            close(state.conv, full_state.conv, 1e-12)


def test_context_parallel_two_pass():
    """Segments scanned from zero, their (state, decay) combined in order, plus the initial
    state's output term, equal the whole scan; with documents crossing segment boundaries,
    one starting exactly at a boundary, and a sequence initial state."""
    g = torch.Generator().manual_seed(3)
    b, length, h, p, gr, n = 2, 40, 4, 3, 2, 5
    x = torch.randn(b, length, h, p, generator=g, dtype=F64)
    dt = F.softplus(torch.randn(b, length, h, generator=g, dtype=F64))
    A = -torch.rand(h, generator=g, dtype=F64) - 0.1
    B, C = torch.randn(2, b, length, gr, n, generator=g, dtype=F64)
    D = torch.randn(h, generator=g, dtype=F64)
    h0 = torch.randn(b, h, p, n, generator=g, dtype=F64)
    reset = torch.zeros(b, length, dtype=torch.bool)
    reset[0, [7, 23]] = True  # 23: inside segment 2; row 1 has one document
    reset[1, 30] = True  # exactly at a segment start
    full, full_final = ssd_scan(x, dt, A, B, C, 8, D, h0, reset)
    bounds = [(0, 9), (9, 20), (20, 30), (30, 40)]
    zero, decays = [], []
    for lo, hi in bounds:
        s = slice(lo, hi)
        _, state = ssd_scan(x[:, s], dt[:, s], A, B[:, s], C[:, s], 8, D, None, reset[:, s])
        zero.append(state)
        decays.append(ssd_total_decay(dt[:, s], A, reset[:, s]))
    starts, final = combine_segment_states(torch.stack(zero), torch.stack(decays), h0)
    close(final, full_final, 1e-12)
    for (lo, hi), start in zip(bounds, starts):
        s = slice(lo, hi)
        y0, _ = ssd_scan(x[:, s], dt[:, s], A, B[:, s], C[:, s], 8, D, None, reset[:, s])
        extra = ssd_initial_state_output(C[:, s], dt[:, s], A, start, reset[:, s])
        close(y0 + extra, full[:, s], 1e-12)
        rescan, _ = ssd_scan(x[:, s], dt[:, s], A, B[:, s], C[:, s], 8, D, start, reset[:, s])
        close(rescan, full[:, s], 1e-12)


def test_context_parallel_mixer_recipe():
    """The whole mixer over segments as context-parallel ranks would run it: the conv halo
    from the previous segment (conv_halo), the scan from zero, the combined initial states and
    their output term, then the gated norm and out_proj: equal to one pass, with documents."""
    mx = make()
    x = torch.randn(2, 40, 64, dtype=F64)
    reset = torch.zeros(2, 40, dtype=torch.bool)
    reset[0, [16, 20]] = True  # 16: a segment's first token
    reset[1, [27, 38]] = True  # 27: the halo sent from 16..28 must drop token 26
    bounds = [(0, 9), (9, 16), (16, 29), (29, 40)]
    with torch.no_grad():
        full = mx(x, reset)
        pieces, zero, decays, halo = [], [], [], None
        for lo, hi in bounds:
            z, xbc, dt = mx.project(x[:, lo:hi])
            act, _ = mx.conv(xbc, halo, reset[:, lo:hi])
            halo = conv_halo(xbc, DIMS.conv_kernel, reset[:, lo:hi])  # what this rank sends
            xs, dts, A, B, C = mx.ssm_inputs(act, dt)
            y0, state = ssd_scan(xs, dts, A, B, C, 8, mx.D, None, reset[:, lo:hi])
            pieces.append((z, y0, dts, A, C))
            zero.append(state)
            decays.append(ssd_total_decay(dts, A, reset[:, lo:hi]))
        starts, _ = combine_segment_states(torch.stack(zero), torch.stack(decays))
        outs = []
        for (lo, hi), (z, y0, dts, A, C), start in zip(bounds, pieces, starts):
            y = y0 + ssd_initial_state_output(C, dts, A, start, reset[:, lo:hi])
            outs.append(mx.out_proj(mx.gate_norm(y, z).to(x.dtype)))
        close(torch.cat(outs, 1), full, 1e-12)


# ---- documents -------------------------------------------------------------------------------


def test_packed_documents_equal_separate_documents():
    mx = make()
    lengths = [5, 11, 3, 13]  # 32 tokens; boundaries inside and at chunk edges
    g = torch.Generator().manual_seed(4)
    docs = [torch.randn(1, n, 64, generator=g, dtype=F64, requires_grad=True) for n in lengths]
    weights = [torch.randn(1, n, 64, generator=g, dtype=F64) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    doc_ids = (position_ids == 0).cumsum(1)
    reset = reset_mask_from_document_ids(doc_ids)
    assert reset[0].nonzero().flatten().tolist() == [5, 16, 19]
    params = list(mx.parameters())
    packed_in = torch.cat(docs, 1)
    packed = mx(packed_in, reset)
    grads_packed = torch.autograd.grad((packed * torch.cat(weights, 1)).sum(), [*docs, *params])
    alone = [mx(d) for d in docs]
    loss_alone = sum((o * w).sum() for o, w in zip(alone, weights))
    grads_alone = torch.autograd.grad(loss_alone, [*docs, *params])
    close(packed, torch.cat(alone, 1), 1e-12)
    for a, b in zip(grads_packed, grads_alone):
        close(a, b, 1e-11)


# ---- decoding --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,rel", [(F64, 1e-12), (torch.float32, 1e-5)])
def test_step_equals_forward(dtype, rel):
    mx = make(dtype=dtype)
    x = torch.randn(2, 19, 64, dtype=dtype)
    with torch.no_grad():
        full = mx(x)
        _, state = mx(x[:, :7], return_state=True)  # prefill, then decode one token at a time
        conv, ssm = state.conv, state.ssm
        outs = []
        for t in range(7, 19):
            out, conv, ssm = mx.step(x[:, t], conv, ssm)
            outs.append(out)
        close(torch.stack(outs, 1), full[:, 7:], rel)
        zero = mx.zero_state(2, dtype=dtype)  # from nothing: the first token too
        conv, ssm = zero.conv, zero.ssm
        out, conv, ssm = mx.step(x[:, 0], conv, ssm)
        close(out, full[:, 0], rel)


# ---- tensor parallel -------------------------------------------------------------------------


def test_tp_shards_reassemble():
    dims = Mamba2Dims(**{**DIMS.__dict__, "use_bias": True})
    mx = make(dims)
    x = torch.randn(2, 21, 64, dtype=F64)
    full_sd = mx.state_dict()
    tp = 2
    shards = [shard_mamba2(full_sd, dims, tp, r) for r in range(tp)]
    with torch.no_grad():
        full_mixed, full_state = mx.mix(x)
        mixed, partial = [], 0
        for shard in shards:
            local = Mamba2Mixer(dims.tp_local(tp), dtype=F64)
            local.load_state_dict(shard, strict=True)
            m, _ = local.mix(x)
            mixed.append(m)
            partial = partial + local.out_proj(m)  # row-parallel: bias added once, after
        close(torch.cat(mixed, -1), full_mixed, 1e-12)
        close(partial + mx.out_proj.bias, mx(x), 1e-12)
    back = unshard_mamba2(shards, dims, out_proj_bias=full_sd["out_proj.bias"])
    assert back.keys() == full_sd.keys()
    assert all(torch.equal(back[k], full_sd[k]) for k in full_sd)


def test_tp_refuses_indivisible_heads_or_groups():
    with pytest.raises(ValueError, match="multiples of tp"):
        DIMS.tp_local(4)  # 2 groups
    with pytest.raises(ValueError, match="multiple of n_groups"):
        Mamba2Dims(64, 6, 16, 4, 16)


def test_state_type():
    state = make().zero_state(3)
    assert isinstance(state, Mamba2State)
    assert state.conv.shape == (3, DIMS.conv_dim, DIMS.conv_kernel - 1)
    assert state.ssm.shape == (3, 8, 16, 16)
