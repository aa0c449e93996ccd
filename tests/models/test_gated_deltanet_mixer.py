"""The Gated DeltaNet mixer (nanotron_models.mixers.gated_deltanet): values against
transformers' Qwen3NextGatedDeltaNet and an fp64 token-by-token recurrence written here;
chunk-size independence, gradients, segment continuation (state + conv halo), packed
documents (values and gradients), decoding steps, the context-parallel affine pieces and the
tensor-parallel shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanotron_models.mixers.gated_deltanet import (
    GatedDeltaNetDims,
    GatedDeltaNetMixer,
    GatedDeltaNetState,
)
from nanotron_models.mixers.gated_deltanet_tp import shard_gated_deltanet, unshard_gated_deltanet
from nanotron_models.mixers.gdn_scan import (
    combine_affine_states,
    gated_delta_rule,
    gated_delta_rule_affine,
)
from nanotron_models.mixers.ssd_scan import conv_halo, reset_mask_from_document_ids

DIMS = GatedDeltaNetDims(
    hidden_size=32, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6,
    conv_kernel=4, chunk_size=8,
)  # fmt: skip
F64 = torch.float64


def randomise_(mixer: GatedDeltaNetMixer, seed: int = 0) -> GatedDeltaNetMixer:
    """Every parameter random (A_log, dt_bias and the norm included), in a sane range."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=F64)
            if name == "A_log":
                r = r * 0.7
            elif name == "norm.weight":
                r = 1 + 0.3 * r
            elif p.ndim > 1:
                r = r / p[0].numel() ** 0.5
            p.copy_(r)
    return mixer


def make(dims: GatedDeltaNetDims = DIMS, dtype=F64, seed: int = 0) -> GatedDeltaNetMixer:
    return randomise_(GatedDeltaNetMixer(dims, dtype=dtype), seed)


def with_chunk(mx: GatedDeltaNetMixer, chunk: int) -> GatedDeltaNetMixer:
    dims = GatedDeltaNetDims(**{**mx.dims.__dict__, "chunk_size": chunk})
    other = GatedDeltaNetMixer(dims, dtype=mx.A_log.dtype)
    other.load_state_dict(mx.state_dict())
    return other


def naive(mx: GatedDeltaNetMixer, hidden: torch.Tensor, reset: torch.Tensor | None = None):
    """The mixer one token at a time, from its definition (not from the module's code)."""
    d = mx.dims
    b, length, _ = hidden.shape
    hk, hv, dk, dv, r = (d.num_key_heads, d.num_value_heads, d.key_head_dim, d.value_head_dim,
                         d.heads_per_key)  # fmt: skip
    reset = torch.zeros(b, length, dtype=torch.bool) if reset is None else reset
    qkvz = (hidden @ mx.in_proj_qkvz.weight.T).view(b, length, hk, -1)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], -1)
    ba = (hidden @ mx.in_proj_ba.weight.T).view(b, length, hk, 2 * r)
    beta, a = ba[..., :r].reshape(b, length, hv).sigmoid(), ba[..., r:].reshape(b, length, hv)
    x = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)
    doc = reset.long().cumsum(1)
    w, k_size = mx.conv1d.weight[:, 0], d.conv_kernel
    conv = []
    for t in range(length):
        acc = 0
        for lag in range(k_size):
            if t - lag >= 0:
                same = (doc[:, t - lag] == doc[:, t])[:, None]
                acc = acc + w[:, k_size - 1 - lag] * x[:, t - lag] * same
        conv.append(F.silu(acc))
    x = torch.stack(conv, 1)
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], -1)

    def unit(t):  # HF's l2norm: t / sqrt(|t|^2 + 1e-6), per key head
        t = t.view(b, length, hk, dk)
        return (t / (t.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(r, 2)

    q, k = unit(q) * dk**-0.5, unit(k)
    v = v.view(b, length, hv, dv)
    decay = torch.exp(-mx.A_log.exp() * F.softplus(a + mx.dt_bias))
    s = hidden.new_zeros(b, hv, dk, dv)
    outs = []
    for t in range(length):
        s = s * (~reset[:, t])[:, None, None, None] * decay[:, t, :, None, None]
        kt = k[:, t]
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", s, kt)
        s = s + kt[..., None] * (beta[:, t, :, None] * err)[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    o = torch.stack(outs, 1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + d.norm_eps) * mx.norm.weight
    o = (o * F.silu(z.reshape(b, length, hv, dv))).flatten(2)
    return o @ mx.out_proj.weight.T


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= rel, f"relative error {err:.3g} > {rel}"


# ---- values ----------------------------------------------------------------------------------


def test_matches_transformers():
    """fp32 (transformers' reference computes the rule in fp32 whatever the dtype)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = Qwen3NextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
        layer_types=["linear_attention"],
    )  # fmt: skip
    ours = make(GatedDeltaNetDims.from_hf(cfg), dtype=torch.float32)
    hf = Qwen3NextGatedDeltaNet(cfg, layer_idx=0).eval()
    assert {k: v.shape for k, v in hf.state_dict().items()} == {
        k: v.shape for k, v in ours.state_dict().items()
    }
    hf.load_state_dict(ours.state_dict())
    x = torch.randn(2, 75, 32, generator=torch.Generator().manual_seed(1))  # 64 + 11: 2 chunks
    with torch.no_grad():
        close(ours(x), hf(x), 1e-5)


def test_fp64_matches_recurrence_and_chunk_sizes_agree():
    mx = make()
    x = torch.randn(2, 37, 32, dtype=F64)
    reset = torch.zeros(2, 37, dtype=torch.bool)
    reset[0, [8, 19]] = True  # 8: a chunk's first token; 19: inside one
    with torch.no_grad():
        for rows in (None, reset):
            ref = naive(mx, x, rows)
            close(mx(x, rows), ref, 1e-11)
            for q in (1, 5, 64):
                close(with_chunk(mx, q)(x, rows), ref, 1e-11)
    fp32 = make(dtype=torch.float32)
    with torch.no_grad():
        close(with_chunk(fp32, 64)(x.float()), fp32(x.float()), 1e-5)


def test_gradients_match_recurrence():
    mx = make()
    x = torch.randn(2, 13, 32, dtype=F64, requires_grad=True)
    w = torch.randn(2, 13, 32, dtype=F64)
    reset = torch.zeros(2, 13, dtype=torch.bool)
    reset[0, 6] = True
    params = [x, *mx.parameters()]
    ours = torch.autograd.grad((mx(x, reset) * w).sum(), params)
    ref = torch.autograd.grad((naive(mx, x, reset) * w).sum(), params)
    for a, b in zip(ours, ref):
        close(a, b, 1e-10)


# ---- segments: continuation, context parallel -----------------------------------------------


def test_continuation_from_state_and_halo():
    """[a; b] in one call equals a, then b from a's final state (delta-rule state + conv
    halo), for cuts inside a chunk, a b shorter than the halo, and documents (one starting in
    a's last K-1 tokens, one exactly at a cut)."""
    mx = make()
    x = torch.randn(2, 30, 32, dtype=F64)
    reset = torch.zeros(2, 30, dtype=torch.bool)
    reset[0, [11, 20]] = True
    reset[1, 8] = True
    with torch.no_grad():
        full, full_state = mx(x, reset, return_state=True)
        for cuts in ([13], [8, 10, 12], [29]):
            state, outs = None, []
            for lo, hi in zip([0, *cuts], [*cuts, 30]):
                out, state = mx(x[:, lo:hi], reset[:, lo:hi], state, return_state=True)
                outs.append(out)
            close(torch.cat(outs, 1), full, 1e-12)
            close(state.recurrent, full_state.recurrent, 1e-12)
            close(state.conv, full_state.conv, 1e-12)


def test_affine_segments_combine_to_the_whole():
    """Segments run from zero with their affine map (gated_delta_rule_affine), chained in
    order (combine_affine_states) with a sequence initial state, plus the initial states'
    output term, equal the whole rule; with documents crossing segments and one starting at a
    segment's first token. Then the whole mixer as cp ranks run it (conv halos too)."""
    g = torch.Generator().manual_seed(3)
    b, length, hk, hv, dk, dv = 2, 40, 2, 4, 5, 3
    q, k = (F.normalize(torch.randn(b, length, hk, dk, generator=g, dtype=F64), dim=-1)
            for _ in range(2))  # fmt: skip
    v = torch.randn(b, length, hv, dv, generator=g, dtype=F64)
    gl = -F.softplus(torch.randn(b, length, hv, generator=g, dtype=F64))
    beta = torch.rand(b, length, hv, generator=g, dtype=F64)
    h0 = torch.randn(b, hv, dk, dv, generator=g, dtype=F64)
    reset = torch.zeros(b, length, dtype=torch.bool)
    reset[0, [7, 23]] = True
    reset[1, 30] = True
    full, full_final = gated_delta_rule(q, k, v, gl, beta, 8, h0, reset)
    bounds = [(0, 9), (9, 20), (20, 30), (30, 40)]
    parts = [gated_delta_rule_affine(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], gl[:, lo:hi],
                                     beta[:, lo:hi], 8, reset[:, lo:hi]) for lo, hi in bounds]  # fmt: skip
    starts, final = combine_affine_states(
        torch.stack([p[1] for p in parts]), torch.stack([p[3] for p in parts]), h0
    )
    close(final, full_final, 1e-12)
    for (lo, hi), (o0, _, read, _), start in zip(bounds, parts, starts):
        close(o0 + torch.einsum("blhk,bhkv->blhv", read, start), full[:, lo:hi], 1e-12)
    mx, x = make(), torch.randn(2, 40, 32, dtype=F64)
    reset[1, 27] = True  # inside the halo that segment [20, 30) hands on
    with torch.no_grad():
        whole, pieces, halo = mx(x, reset), [], None
        for lo, hi in bounds:
            qkv, z, bb, a = mx.project(x[:, lo:hi])
            act, _ = mx.conv(qkv, halo, reset[:, lo:hi])
            halo = conv_halo(qkv, DIMS.conv_kernel, reset[:, lo:hi])
            pieces.append((z, gated_delta_rule_affine(*mx.delta_inputs(act, bb, a), 8,
                                                      reset[:, lo:hi])))  # fmt: skip
        starts, _ = combine_affine_states(
            torch.stack([p[1][1] for p in pieces]), torch.stack([p[1][3] for p in pieces])
        )
        outs = [mx.out_proj(mx.gate_norm(o0 + torch.einsum("blhk,bhkv->blhv", read, s), z))
                for (z, (o0, _, read, _)), s in zip(pieces, starts)]  # fmt: skip
        close(torch.cat(outs, 1), whole, 1e-12)


# ---- documents -------------------------------------------------------------------------------


def test_packed_documents_equal_separate_documents():
    mx = make()
    lengths = [5, 11, 3, 13]  # 32 tokens; boundaries inside and at chunk edges (chunk 8)
    g = torch.Generator().manual_seed(4)
    docs = [torch.randn(1, n, 32, generator=g, dtype=F64, requires_grad=True) for n in lengths]
    weights = [torch.randn(1, n, 32, generator=g, dtype=F64) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    reset = reset_mask_from_document_ids((position_ids == 0).cumsum(1))
    assert reset[0].nonzero().flatten().tolist() == [5, 16, 19]
    params = list(mx.parameters())
    packed = mx(torch.cat(docs, 1), reset)
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
    x = torch.randn(2, 19, 32, dtype=dtype)
    with torch.no_grad():
        full = mx(x)
        _, state = mx(x[:, :7], return_state=True)  # prefill, then one token at a time
        conv, rec = state.conv, state.recurrent
        outs = []
        for t in range(7, 19):
            out, conv, rec = mx.step(x[:, t], conv, rec)
            outs.append(out)
        close(torch.stack(outs, 1), full[:, 7:], rel)
        zero = mx.zero_state(2, dtype=dtype)
        assert isinstance(zero, GatedDeltaNetState)
        assert zero.conv.shape == (2, DIMS.conv_dim, 3) and zero.recurrent.shape == (2, 4, 8, 6)
        out, _, _ = mx.step(x[:, 0], zero.conv, zero.recurrent)
        close(out, full[:, 0], rel)


# ---- tensor parallel (in one process; tp2 in gloo processes: test_gated_deltanet_parallel) --


def test_tp_shards_reassemble():
    mx = make()
    x = torch.randn(2, 21, 32, dtype=F64)
    full_sd = mx.state_dict()
    tp = 2
    shards = [shard_gated_deltanet(full_sd, DIMS, tp, r) for r in range(tp)]
    with torch.no_grad():
        full_mixed, _ = mx.mix(x)
        mixed, partial = [], 0
        for shard in shards:
            local = GatedDeltaNetMixer(DIMS.tp_local(tp), dtype=F64)
            local.load_state_dict(shard, strict=True)
            m, _ = local.mix(x)
            mixed.append(m)
            partial = partial + local.out_proj(m)  # row-parallel: the partial outputs sum
        close(torch.cat(mixed, -1), full_mixed, 1e-12)
        close(partial, mx(x), 1e-12)
    back = unshard_gated_deltanet(shards, DIMS)
    assert back.keys() == full_sd.keys()
    assert all(torch.equal(back[k], full_sd[k]) for k in full_sd)


def test_refusals():
    with pytest.raises(ValueError, match="linear_num_key_heads \\(2\\) and linear_num_value_"):
        DIMS.tp_local(4)
    with pytest.raises(ValueError, match="must be a multiple of linear_num_key_heads"):
        GatedDeltaNetDims(32, 4, 6, 8, 8)
