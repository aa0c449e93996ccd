"""RoPE, parameter count, FLOPs, block list and attention backend selection."""

from __future__ import annotations

import logging

import pytest
import torch
from models_helpers import LLAMA3_SCALING, hf_model, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from nanotron_models import (
    build_llama,
    llama_block_costs,
    llama_block_names,
    llama_block_specs,
    num_parameters,
    resolve_backend,
    training_flops_per_token,
)
from nanotron_models.attention import attention
from nanotron_models.blocks import _SwiGLUFunction
from nanotron_models.hf import config_to_hf
from nanotron_models.rotary import RotaryTable, apply_rotary, rope_inv_freq, rotate_qkv


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_rope_frequencies_equal_hf(scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_config(rope_scaling=scaling, hidden_size=128)
    hf_rope = LlamaRotaryEmbedding(config_to_hf(config))
    ours = rope_inv_freq(config.head_dim, config.rope_theta, scaling)
    assert torch.equal(ours, hf_rope.inv_freq)
    if scaling is not None:  # scaling really changes the low frequencies
        assert not torch.equal(ours, rope_inv_freq(config.head_dim, config.rope_theta))
    pos = torch.arange(40)[None]
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), pos)
    our_cos, our_sin = RotaryTable(config.head_dim, config.rope_theta, scaling).cos_sin(
        pos[0], torch.device("cpu"), torch.float32
    )
    assert torch.equal(our_cos, cos[0]) and torch.equal(our_sin, sin[0])


def test_rope_range_is_the_gathered_rows_made_once():
    """Batches without position ids rotate by slices of the table: bitwise the rows a gather
    of those positions gives, the same views for every layer of a step (no position tensor
    nor gather per layer), remade for another range or a grown table."""
    table, cpu = RotaryTable(16, 10000.0), torch.device("cpu")
    for offset, length in ((0, 12), (5, 3), (0, 40)):  # decoding offsets; the table grows
        cos, sin = table.cos_sin_range(offset, length, cpu, torch.float32)
        want = table.cos_sin(torch.arange(offset, offset + length), cpu, torch.float32)
        assert cos.shape == (length, 1, 1, 16)
        assert torch.equal(cos[:, 0, 0], want[0]) and torch.equal(sin[:, 0, 0], want[1])
        again = table.cos_sin_range(offset, length, cpu, torch.float32)
        assert again[0] is cos and again[1] is sin
    with _OpNames() as ops:
        table.cos_sin_range(0, 7, cpu, torch.float32)  # a new range: slices, no gather
        table.cos_sin_range(0, 7, cpu, torch.float32)  # the same again: no op
    assert "index" not in ops.names and "arange" not in ops.names, ops.names
    assert ops.names.count("slice") == 2, ops.names


class _OpNames(TorchDispatchMode):
    """The aten ops run under it, by name (cheaper than starting the profiler)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tie", [False, True])
def test_num_parameters_equals_hf(tie):
    config = tiny_config(tie)
    hf = hf_model(config)
    assert num_parameters(config) == sum(p.numel() for p in hf.parameters())


def test_training_flops_formula():
    config = tiny_config()  # h=64, L=2, heads 4 (d=16), kv 2, I=96, V=101
    layer = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 96
    n = 2 * layer + 101 * 64
    assert training_flops_per_token(config, 128) == 6 * n + 12 * 2 * 64 * 128
    # Llama-2-7B-like shapes give the well-known ~6.7e9 matmul parameters -> ~4.2e10 FLOPs/tok.
    big = tiny_config(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    )
    assert 6.5e9 < num_parameters(big) < 6.8e9
    # Matmul weights = all parameters minus the embedding table and the 2L+1 norm vectors.
    n_matmul = num_parameters(big) - 32000 * 4096 - (2 * 32 + 1) * 4096
    assert training_flops_per_token(big, 4096) == 6 * n_matmul + 12 * 32 * 4096 * 4096


def test_block_names_and_costs():
    config = tiny_config(num_hidden_layers=3)
    names = llama_block_names(config)
    assert names == [
        "embedding",
        "decoder.0",
        "decoder.1",
        "decoder.2",
        "final_norm",
        "lm_head",
        "loss",
    ]
    costs = llama_block_costs(config, 32)
    assert len(costs) == len(names) and all(c > 0 for c in costs)
    assert costs[1] == costs[2] == costs[3]
    assert costs[5] == 2 * 32 * 101 * 64  # lm_head: 2 * s * V * h
    specs = llama_block_specs(config, 32)
    assert [s.name for s in specs] == names and [s.cost for s in specs] == costs


def test_backend_selection_falls_back_to_sdpa_quietly_on_cpu_and_warns_once_on_gpu(
    caplog, monkeypatch
):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    from nanotron_models import attention as attn_mod

    attn_mod._log_once.cache_clear()
    monkeypatch.setattr(attn_mod, "flash_attn_available", lambda: False)
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.INFO, logger="nanotron_models.attention"):
        # Nanotron's default _attn_implementation asks for flash-attn: on a CPU, not a warning.
        assert [resolve_backend(b, cpu) for b in ("flash_attn", "auto", "sdpa")] == ["sdpa"] * 3
        assert caplog.records == []
        assert resolve_backend("flash_attn", cuda) == "sdpa"
        assert resolve_backend("flash_attn", cuda) == "sdpa"  # once per process
        assert resolve_backend("auto", cuda) == "sdpa"
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels == [
        ("WARNING", "attn_backend=flash_attn: flash_attn is not installed; using sdpa"),
        ("INFO", "attn_backend=auto: flash_attn is not installed; using sdpa"),
    ]
    attn_mod._log_once.cache_clear()
    caplog.clear()
    monkeypatch.setenv("RANK", "3")  # the other ranks say nothing
    assert resolve_backend("flash_attn", cuda) == "sdpa" and caplog.records == []
    attn_mod._log_once.cache_clear()
    with pytest.raises(ValueError, match="xformers"):
        resolve_backend("xformers", cpu)


def test_sdpa_gqa_with_cached_prefix_equals_naive():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 4, 8, generator=gen)  # 3 new queries after 5 cached keys
    k, v = torch.randn(8, 2, 2, 8, generator=gen), torch.randn(8, 2, 2, 8, generator=gen)
    out = attention(q, k, v, "sdpa")
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) / 8**0.5
    allowed = torch.arange(8)[None, :] <= torch.arange(3)[:, None] + 5
    scores = scores.masked_fill(~allowed, float("-inf"))
    naive = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), vv)
    torch.testing.assert_close(out, naive, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_fused_loss_swiglu_and_rotary_match_plain_ops(pc1, tie):
    """The SwiGLU (bitwise) and q/k rotation Functions against the plain ops they replace; the
    default model (fused lm_head + loss) against the same weights with the logits
    materialised: loss, z-loss and every gradient within 1e-6, masked labels, grad and
    no_grad."""
    import torch.nn.functional as F

    config = tiny_config(tie, z_loss_enabled=True, z_loss_coefficient=0.01)
    fused = build_llama(config, pc1, seed=3)
    plain = build_llama(config, pc1, seed=3)
    plain.set_fused_loss(False)
    gate_up = torch.randn(5, 2, 2 * config.intermediate_size, requires_grad=True)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    want.square().sum().backward()
    want_grad, gate_up.grad = gate_up.grad, None
    swiglu = _SwiGLUFunction.apply(gate_up)
    swiglu.square().sum().backward()
    assert torch.equal(swiglu, want) and torch.equal(gate_up.grad, want_grad)

    # q/k rotation of the fused projection, per-position cos/sin [s, b, 1, d] (position_ids)
    qkv = torch.randn(7, 2, 4 + 2 * 2, 16, requires_grad=True)
    angles = torch.randn(7, 2, 1, 8)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    up = [torch.randn(7, 2, n, 16) for n in (4, 2, 2)]
    qk, v = qkv.split([6, 2], dim=2)
    want = [*apply_rotary(qk, cos, sin).split([4, 2], dim=2), v]
    torch.autograd.backward(want, up)
    want_grad, qkv.grad = qkv.grad, None
    got = rotate_qkv(qkv, cos, sin, 4, 2)
    torch.autograd.backward(got, up)
    for a, b in zip([*got, qkv.grad], [*want, want_grad]):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 13), generator=gen)
    batch = {"input_ids": ids[:, :-1], "label_ids": ids[:, 1:],
             "label_mask": torch.rand(2, 12, generator=gen) > 0.3}  # fmt: skip
    results = []
    for model in (fused, plain):
        loss = model(None, batch)
        loss.backward()
        with torch.no_grad():
            eval_loss = model(None, batch)
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((loss.detach(), eval_loss, model.loss.z_loss_sum, grads))
    assert fused.fused_loss and not plain.fused_loss
    (loss, eval_loss, z, grads), (loss0, eval0, z0, grads0) = results
    assert float(z0) > 0 and not eval_loss.requires_grad
    for got, ref in ((loss, loss0), (eval_loss, eval0), (z, z0)):
        assert torch.allclose(got, ref, rtol=1e-6, atol=0), (got, ref)
    for name, ref in grads0.items():
        err = (grads[name] - ref).abs().max() / ref.abs().max()
        assert err < 1e-6, (name, float(err))
