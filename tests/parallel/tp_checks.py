"""Checks run inside every rank: tensor-parallel results vs plain torch on the same full weights.

Every rank draws the same full tensors from one seed, builds the reference with torch.nn /
F.cross_entropy, and compares its own shard of the outputs and gradients. Each check returns
the relative error max|a - b| / max|b|; the test asserts it is <= 1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanotron_parallel import (
    ColumnParallelLinear,
    ParallelConfigError,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_gather_to_tp,
    copy_to_tp,
    gather_from_tp,
    gather_full,
    get_param_meta,
    reduce_from_tp,
    reduce_scatter_from_tp,
    scatter_to_tp,
    shard_tensor,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_with_z_loss,
    vocab_parallel_linear_cross_entropy,
)

SEQ, BATCH, IN, OUT, VOCAB = 8, 2, 8, 12, 16
MODES = ("ALL_REDUCE", "REDUCE_SCATTER")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / max(scale, 1e-30)


def _seq_shard(x: torch.Tensor, mode: str, rank: int, tp: int) -> torch.Tensor:
    """The part of a [seq, ...] activation this rank holds between tp regions."""
    return shard_tensor(x, 0, rank, tp) if mode == "REDUCE_SCATTER" else x


def _record(errs: dict, name: str, pairs: dict) -> None:
    for what, (got, want) in pairs.items():
        errs[f"{name}.{what}"] = rel_err(got, want)


def check_column(pc: ParallelContext, mode: str, errs: dict, gather: bool, sections=None) -> None:
    r, tp, g = pc.tp_rank, pc.tp_size, torch.Generator().manual_seed(1)
    ref = nn.Linear(IN, OUT, bias=True)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(OUT, IN, generator=g))
        ref.bias.copy_(torch.randn(OUT, generator=g))
    x = torch.randn(SEQ, BATCH, IN, generator=g, requires_grad=True)
    up = torch.randn(SEQ, BATCH, OUT, generator=g)
    (ref(x) * up).sum().backward()
    want_y = ref(x).detach()

    layer = ColumnParallelLinear(
        IN, OUT, pc.tp_group, mode, bias=True, gather_output=gather, sections=sections
    )
    layer.load_full(ref.weight.detach(), ref.bias.detach())
    x_local = _seq_shard(x.detach(), mode, r, tp).requires_grad_(True)
    y = layer(x_local)
    up_local = up if gather else shard_tensor(up, -1, r, tp, sections)
    want_local = want_y if gather else shard_tensor(want_y, -1, r, tp, sections)
    (y * up_local).sum().backward()
    name = f"{mode}.column{'_gather' if gather else ''}{'_sections' if sections else ''}"
    _record(
        errs,
        name,
        {
            "out": (y.detach(), want_local),
            "grad_x": (x_local.grad, _seq_shard(x.grad, mode, r, tp)),
            "grad_w": (layer.weight.grad, shard_tensor(ref.weight.grad, 0, r, tp, sections)),
            "grad_b": (layer.bias.grad, shard_tensor(ref.bias.grad, 0, r, tp, sections)),
            "gather_full_w": (gather_full(layer.weight, pc.tp_group, 0, sections), ref.weight),
        },
    )
    meta = get_param_meta(layer.weight)
    assert meta is not None and meta.full_shape == (OUT, IN) and meta.shard_dim == 0
    assert (meta.tp_rank, meta.tp_size) == (r, tp)


def check_row(pc: ParallelContext, mode: str, errs: dict) -> None:
    r, tp, g = pc.tp_rank, pc.tp_size, torch.Generator().manual_seed(2)
    ref = nn.Linear(IN, OUT, bias=True)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(OUT, IN, generator=g))
        ref.bias.copy_(torch.randn(OUT, generator=g))
    x = torch.randn(SEQ, BATCH, IN, generator=g, requires_grad=True)
    up = torch.randn(SEQ, BATCH, OUT, generator=g)
    y_ref = ref(x)
    (y_ref * up).sum().backward()

    layer = RowParallelLinear(IN, OUT, pc.tp_group, mode, bias=True)
    layer.load_full(ref.weight.detach(), ref.bias.detach())
    x_local = shard_tensor(x.detach(), -1, r, tp).requires_grad_(True)
    y = layer(x_local)
    (y * _seq_shard(up, mode, r, tp)).sum().backward()
    _record(
        errs,
        f"{mode}.row",
        {
            "out": (y.detach(), _seq_shard(y_ref.detach(), mode, r, tp)),
            "grad_x": (x_local.grad, shard_tensor(x.grad, -1, r, tp)),
            "grad_w": (layer.weight.grad, shard_tensor(ref.weight.grad, 1, r, tp)),
            "grad_b": (layer.bias.grad, ref.bias.grad),
        },
    )


def check_embedding(pc: ParallelContext, mode: str, errs: dict) -> None:
    r, tp, g = pc.tp_rank, pc.tp_size, torch.Generator().manual_seed(3)
    ref = nn.Embedding(VOCAB, IN)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(VOCAB, IN, generator=g))
    ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    up = torch.randn(SEQ, BATCH, IN, generator=g)
    y_ref = ref(ids)
    (y_ref * up).sum().backward()

    layer = VocabParallelEmbedding(VOCAB, IN, pc.tp_group, mode)
    layer.load_full(ref.weight.detach())
    y = layer(ids)
    (y * _seq_shard(up, mode, r, tp)).sum().backward()
    _record(
        errs,
        f"{mode}.embedding",
        {
            "out": (y.detach(), _seq_shard(y_ref.detach(), mode, r, tp)),
            "grad_w": (layer.weight.grad, shard_tensor(ref.weight.grad, 0, r, tp)),
        },
    )


def check_cross_entropy(pc: ParallelContext, errs: dict, vocab: int) -> None:
    """Logits over a vocab padded up to a multiple of tp; padding columns must not count."""
    r, tp, g = pc.tp_rank, pc.tp_size, torch.Generator().manual_seed(4 + vocab)
    padded = -(-vocab // tp) * tp
    logits = torch.randn(SEQ, BATCH, padded, generator=g) * 3
    targets = torch.randint(0, vocab, (SEQ, BATCH), generator=g)
    up = torch.rand(SEQ, BATCH, generator=g)
    full = logits.clone().requires_grad_(True)
    loss_ref = F.cross_entropy(
        full[..., :vocab].reshape(-1, vocab), targets.reshape(-1), reduction="none"
    ).view(SEQ, BATCH)
    (loss_ref * up).sum().backward()

    local = shard_tensor(logits, -1, r, tp).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, targets, pc.tp_group, vocab_size=vocab)
    (loss * up).sum().backward()
    assert loss.dtype == torch.float32
    _record(
        errs,
        f"cross_entropy_v{vocab}",
        {
            "loss": (loss.detach(), loss_ref.detach()),
            "grad": (local.grad, shard_tensor(full.grad, -1, r, tp)),
        },
    )


def check_fused_loss(pc: ParallelContext, errs: dict, vocab: int, z: float) -> None:
    """The fused lm_head + cross-entropy against the unfused path (column-parallel matmul,
    then the vocab-parallel cross-entropy), on a weighted sum with masked tokens (one with an
    ignore-index label), several token chunks, an incoming gradient of 0.5, and no_grad."""
    r, tp, g = pc.tp_rank, pc.tp_size, torch.Generator().manual_seed(40 + vocab)
    padded, tokens = -(-vocab // tp) * tp, SEQ * BATCH
    hidden = torch.randn(tokens, IN, generator=g)
    weight = shard_tensor(torch.randn(padded, IN, generator=g), 0, r, tp)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[3] = -100
    mask = torch.rand(tokens, generator=g) > 0.25
    mask[3] = False
    w = mask.float() / mask.sum()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(copy_to_tp(h_ref, pc.tp_group), w_ref)
    if z:
        per_token, z_tok = vocab_parallel_cross_entropy_with_z_loss(
            logits, targets, pc.tp_group, vocab, z
        )
        z_ref = (z_tok * w).sum()
    else:
        per_token = vocab_parallel_cross_entropy(logits, targets, pc.tp_group, vocab)
        z_ref = torch.zeros(())
    loss_ref = (per_token * w).sum()
    (0.5 * loss_ref).backward()

    h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, z_sum = vocab_parallel_linear_cross_entropy(
        copy_to_tp(h, pc.tp_group), wt, targets, w, pc.tp_group, vocab, z, chunk_rows=5
    )
    (0.5 * loss).backward()
    with torch.no_grad():
        eval_loss, _ = vocab_parallel_linear_cross_entropy(
            hidden, weight.requires_grad_(), targets, w, pc.tp_group, vocab, z, chunk_rows=7
        )
    assert not eval_loss.requires_grad and not z_sum.requires_grad
    _record(
        errs,
        f"fused_loss_v{vocab}_z{z}",
        {
            "loss": (loss.detach(), loss_ref.detach()),
            "z_loss": (z_sum, z_ref) if z else (z_sum, torch.zeros(())),
            "eval_loss": (eval_loss, loss_ref.detach()),
            "grad_hidden": (h.grad, h_ref.grad),
            "grad_weight": (wt.grad, w_ref.grad),
        },
    )


def check_collectives(pc: ParallelContext, errs: dict) -> None:
    """Each differentiable collective's forward and backward against its definition.

    Every rank q has a small input xs[q], a big input big[q] (the dim scaled by tp) and
    upstream gradients of both sizes; all are drawn from one seed so each rank knows all.
    """
    r, tp, group = pc.tp_rank, pc.tp_size, pc.tp_group
    for dim in (0, 1, -1):
        g = torch.Generator().manual_seed(10 + dim)
        small = [4, 3, 4]
        large = list(small)
        large[dim] *= tp
        xs, us = torch.randn(tp, *small, generator=g), torch.randn(tp, *small, generator=g)
        big, bigu = torch.randn(tp, *large, generator=g), torch.randn(tp, *large, generator=g)
        cat_x, cat_u = torch.cat(list(xs), dim=dim), torch.cat(list(us), dim=dim)
        cases = {
            # name: (fn, input, upstream grad, expected output, expected input grad)
            "scatter": (scatter_to_tp, cat_x, us[r], xs[r], cat_u),
            "gather": (gather_from_tp, xs[r], bigu[r], cat_x, bigu[r].chunk(tp, dim)[r]),
            "all_gather": (all_gather_to_tp, xs[r], bigu[r], cat_x, bigu.sum(0).chunk(tp, dim)[r]),
            "reduce_scatter": (
                reduce_scatter_from_tp,
                big[r],
                us[r],
                big.sum(0).chunk(tp, dim)[r],
                cat_u,
            ),
        }
        if dim == 0:
            cases["copy"] = (copy_to_tp, xs[r], us[r], xs[r], us.sum(0))
            cases["reduce"] = (reduce_from_tp, xs[r], us[r], xs.sum(0), us[r])
        for name, (fn, inp, up, want_out, want_grad) in cases.items():
            x = inp.clone().requires_grad_(True)
            out = fn(x, group) if name in ("copy", "reduce") else fn(x, group, dim=dim)
            (out * up).sum().backward()
            _record(
                errs,
                f"collective.{name}.dim{dim}",
                {"out": (out.detach(), want_out), "grad": (x.grad, want_grad)},
            )


def expect_error(fn, *needles: str) -> str:
    """Run fn, which must raise ParallelConfigError mentioning every needle; return message."""
    try:
        fn()
    except ParallelConfigError as err:
        msg = str(err)
        assert all(n in msg for n in needles), (msg, needles)
        return msg
    raise AssertionError(f"no ParallelConfigError (wanted {needles})")


def check_errors(pc: ParallelContext) -> list[str]:
    """User errors a tp > 1 layout can cause, each with a clear message."""
    tp, group = pc.tp_size, pc.tp_group
    msgs = [
        expect_error(
            lambda: ColumnParallelLinear(IN, OUT, group, "ALL_REDUCE", async_communication=True),
            "async_communication",
            "needs tp_mode REDUCE_SCATTER",
        ),
        expect_error(
            lambda: ColumnParallelLinear(IN, tp + 1, group, "ALL_REDUCE"),
            f"out_features={tp + 1}",
            f"tp={tp}",
        ),
        expect_error(lambda: RowParallelLinear(tp + 1, OUT, group, "ALL_REDUCE"), f"tp={tp}"),
        expect_error(lambda: VocabParallelEmbedding(tp + 1, IN, group, "ALL_REDUCE"), f"tp={tp}"),
        expect_error(lambda: ColumnParallelLinear(IN, OUT, group, "SIDEWAYS"), "SIDEWAYS"),
    ]
    row = RowParallelLinear(IN, OUT, group, "REDUCE_SCATTER")
    odd_seq = torch.randn(tp + 1, BATCH, IN // tp)
    msgs.append(expect_error(lambda: row(odd_seq), f"size {tp + 1}", f"tensor-parallel size {tp}"))
    # Target ids are not range-checked by the loss (a device sync per call); the trainer's
    # data checks every sample where it is read (tests/train/test_data_sampling.py).
    logits = torch.randn(2, VOCAB // tp)
    msgs.append(
        expect_error(
            lambda: vocab_parallel_cross_entropy(logits, torch.tensor([0, 1]), group, VOCAB + 99),
            f"vocab_size={VOCAB + 99}",
        )
    )
    return msgs


def tp_worker(tp: int) -> dict:
    """All primitives, both modes, one process group: returns {check: relative error}."""
    torch.set_num_threads(1)
    pc = ParallelContext(tp=tp)
    try:
        errs: dict = {}
        for mode in MODES:
            check_column(pc, mode, errs, gather=False)
            check_column(pc, mode, errs, gather=True)
            check_column(pc, mode, errs, gather=False, sections=[8, 4])
            check_row(pc, mode, errs)
            check_embedding(pc, mode, errs)
        for vocab in sorted({VOCAB, VOCAB - 1, 2 * tp + 1}):
            check_cross_entropy(pc, errs, vocab)
            for z in (0.0, 0.01):
                check_fused_loss(pc, errs, vocab, z)
        check_collectives(pc, errs)
        messages = check_errors(pc) if tp > 1 else []
        return {"errs": errs, "messages": messages}
    finally:
        pc.destroy()
