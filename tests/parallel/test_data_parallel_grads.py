"""The data-parallel gradient buffers across steps, and the gradient norm's share per rank.

The buffers are not cleared between steps: a step's first gradient of a parameter is written,
later ones added, and a parameter no micro-batch reached is zeroed before its reduction. The
values must be exactly those of accumulating into zeroed buffers. Under ZeRO-0 each dp rank
norms its 1/dp of every (identical) reduced buffer; on the CPU the views are 2-D, a norm per
16k-element row, bitwise the norms of 16k-element pieces. A tensor-parallel linear's weight
gradient skips autograd: its matmul runs into the buffer (gradient-accumulation fusion), with
autograd's values.
"""

from __future__ import annotations

import torch
from torch import nn

from nanotron_parallel.clip import _norms, global_grad_norm
from nanotron_parallel.data_parallel import DataParallelGrads, build_data_parallel
from nanotron_parallel.data_parallel.accumulate import accumulate_product
from nanotron_parallel.data_parallel.buckets import _NORM_PIECE

SIZES = (5, 40_000, 3)  # the middle one spans rows of the CPU norm, with a tail


def _grads(step: int, micro: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n)) for n in SIZES]


def _backward(params, grads, used) -> None:
    """What autograd does: the gradient lands in .grad, then the post-accumulate hooks run."""
    for p, g, u in zip(params, grads, used):
        if u:
            (p * g).sum().backward()


def _dp_worker(zero_stage: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    params = _params()
    dp = build_data_parallel(zero_stage, params, None, world, rank, bucket_cap_mb=0.1)
    out = {}
    # step 1: all parameters used, two micro-batches; step 2: the last parameter unused
    for step, used in ((1, (True, True, True)), (2, (True, True, False))):
        dp.zero_grad()
        for micro in range(2):
            if micro == 1:
                dp.arm()
            _backward(params, _grads(step, micro, rank), used)
        dp.finish()
        out[step] = [p.main_grad.clone() for p in params]
    views = dp.grad_norm_views(lambda p: True)
    out["norm"] = float(global_grad_norm(views, None, torch.device("cpu")))
    out["counted"] = sum(v.numel() for v in views)
    dist.destroy_process_group()
    return out


def _expected_step(step: int, used, world: int) -> list[torch.Tensor]:
    """Zeroed buffers, each rank's micro-batches added pre-divided, summed over ranks."""
    total = [torch.zeros(n) for n in SIZES]
    for rank in range(world):
        local = [torch.zeros(n) for n in SIZES]
        for micro in range(2):
            for buf, g, u in zip(local, _grads(step, micro, rank), used):
                if u:
                    buf.add_(g, alpha=1.0 / world)
        for t, buf in zip(total, local):
            t.add_(buf)
    return total


def test_buffers_are_rewritten_each_step_and_the_norm_is_shared_over_dp():
    from nanotron_parallel.testing import run_distributed

    results = run_distributed(_dp_worker, 2, 0, timeout=120)
    want1 = _expected_step(1, (True, True, True), 2)
    want2 = _expected_step(2, (True, True, False), 2)
    for res in results:
        assert all(torch.equal(a, b) for a, b in zip(res[1], want1))
        # step 2 holds step 2's gradients only; the unused parameter's are zero
        assert all(torch.equal(a, b) for a, b in zip(res[2], want2))
        assert torch.count_nonzero(res[2][2]) == 0
    full = torch.cat(want2).double()
    counted = [r["counted"] for r in results]  # about half each, every element once
    assert sum(counted) == sum(SIZES) and abs(counted[0] - counted[1]) <= 2, counted
    for res in results:  # every rank the same norm, each element counted once
        assert abs(res["norm"] - float(full.square().sum().sqrt())) <= 1e-6 * res["norm"]


def _one_process_step(step: int):
    """Parameters and their dp object (one process) after a step that used them all."""
    params = _params()
    dp = build_data_parallel(0, params, None, 1, 0)
    dp.zero_grad()
    _backward(params, _grads(step, 0, 0), (True, True, True))
    dp.finish()
    return params, dp


def test_single_process_overwrites_and_clears_without_a_zeroing_pass():
    params, dp = _one_process_step(1)
    dp.zero_grad()
    _backward(params, _grads(2, 0, 0), (True, False, False))
    _backward(params, _grads(2, 1, 0), (True, False, False))
    dp.finish()
    g1, g2 = _grads(2, 0, 0)[0], _grads(2, 1, 0)[0]
    assert torch.equal(params[0].main_grad, torch.zeros(5).add_(g1).add_(g2))
    assert torch.count_nonzero(params[1].main_grad) == 0
    assert torch.count_nonzero(params[2].main_grad) == 0


def test_cpu_norm_rows_are_the_norms_of_16k_pieces_bitwise():
    _, dp = _one_process_step(3)
    views = dp.grad_norm_views(lambda p: True)
    assert any(v.dim() == 2 and v.shape[1] == _NORM_PIECE for v in views)
    flat = torch.cat([v.reshape(-1) for v in views])
    pieces = [piece for v in views for piece in v.reshape(-1).split(_NORM_PIECE)]
    assert flat.numel() == sum(SIZES)
    assert torch.equal(_norms(views), torch.stack(torch._foreach_norm(pieces)))


def test_a_large_last_gradient_has_a_bucket_of_its_own():
    # forward order: an embedding-sized parameter first, so its gradient arrives last
    params = [nn.Parameter(torch.zeros(n)) for n in (300_000, 50_000, 50_000)]
    dp = build_data_parallel(0, params, None, 1, 0, bucket_cap_mb=1.0)  # 262144 elements
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b.params] for b in dp.buckets] == [[2, 1], [0]]
    small_first = [nn.Parameter(torch.zeros(n)) for n in (1_000, 100_000, 100_000)]
    dp = build_data_parallel(0, small_first, None, 1, 0, bucket_cap_mb=1.0)
    assert [len(b.params) for b in dp.buckets] == [3]  # a small last one stays with the rest


# -- gradient-accumulation fusion: a linear's weight gradient computed into its buffer ---------


def _linears_and_inputs(micro_batches: int):
    from nanotron_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    column = ColumnParallelLinear(24, 40, None, "ALL_REDUCE", bias=True)
    row = RowParallelLinear(40, 24, None, "ALL_REDUCE")
    for weight in (column.weight, column.bias, row.weight):
        nn.init.normal_(weight, std=0.2)
    inputs = [torch.randn(16, 2, 24) for _ in range(micro_batches)]
    return column, row, inputs


def _accumulated(fuse: bool, micro_batches: int, grad_scale: float) -> tuple[list, int]:
    """The buffers after `micro_batches` backwards of row(column(x)), fused or through
    autograd, and how many gradients passed through autograd's accumulation."""
    from torch.profiler import ProfilerActivity, profile

    from nanotron_parallel.tensor_parallel.layers import _TPLinearBase

    column, row, inputs = _linears_and_inputs(micro_batches)
    params = [column.weight, column.bias, row.weight]
    dp = DataParallelGrads(params, None, 1, 0, grad_scale=grad_scale)
    dp.zero_grad()
    _TPLinearBase.fuse_grad_accumulation = fuse
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for x in inputs:
                row(torch.relu(column(x))).square().sum().backward()
    finally:
        _TPLinearBase.fuse_grad_accumulation = True
    dp.finish()
    through_autograd = sum(e.name == "torch::autograd::AccumulateGrad" for e in prof.events())
    assert all(p.grad is None for p in params)
    return [p.main_grad.clone() for p in params], through_autograd


def test_fused_weight_gradients_equal_autograd_accumulation():
    from nanotron_parallel.testing import shared_default_group

    with shared_default_group():
        for scale in (1.0, 0.5):  # 0.5: a dp=2 buffer's pre-divided gradients
            fused, n_fused = _accumulated(True, 1, scale)
            plain, n_plain = _accumulated(False, 1, scale)
            # one micro-batch: the matmul writes exactly autograd's gradient, scaled
            assert all(torch.equal(a, b) for a, b in zip(fused, plain))
            assert (n_fused, n_plain) == (1, 3)  # only the bias went through autograd
            fused, n_fused = _accumulated(True, 3, scale)
            plain, n_plain = _accumulated(False, 3, scale)
            # later micro-batches add in the matmul (one rounding instead of two)
            for a, b in zip(fused, plain):
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
            assert (n_fused, n_plain) == (3, 9)


def test_fused_product_of_low_precision_factors_into_fp32():
    main = torch.full((6, 5), float("nan"))  # stale values are never read on a first write
    a, b = torch.randn(6, 7).bfloat16(), torch.randn(7, 5).bfloat16()
    accumulate_product(main, a, b, 0.5, first=True)
    assert torch.equal(main, a.mm(b).float() * 0.5)
    accumulate_product(main, a, b, 0.5, first=False)
    assert torch.equal(main, (a.mm(b).float() * 0.5).add_(a.mm(b), alpha=0.5))
    nan = torch.full((6, 5), float("nan"))
    a32, b32 = a.float(), b.float()
    accumulate_product(nan, a32, b32, 0.5, first=True)
    assert torch.equal(nan, a32.mm(b32) * 0.5)


def _embedding_accumulated(fuse: bool, micro_batches: int, grad_scale: float):
    """The embedding's buffer after `micro_batches` backwards, fused or through autograd, and
    how many table-sized gradients autograd made."""
    from torch.profiler import ProfilerActivity, profile

    from nanotron_parallel.tensor_parallel import VocabParallelEmbedding

    torch.manual_seed(0)
    emb = VocabParallelEmbedding(50, 12, None, "ALL_REDUCE")
    emb.fuse_grad_accumulation = fuse
    ids = [torch.randint(0, 20, (16, 2)) for _ in range(micro_batches)]  # repeated ids
    targets = [torch.randn(16, 2, 12) for _ in range(micro_batches)]
    dp = DataParallelGrads([emb.weight], None, 1, 0, grad_scale=grad_scale)
    dp.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, t in zip(ids, targets):
            (emb(x) * t).square().sum().backward()
    dp.finish()
    tables = sum(e.name == "aten::embedding_dense_backward" for e in prof.events())
    assert emb.weight.grad is None
    return emb.weight.main_grad.clone(), tables


def test_fused_embedding_gradient_equals_autograd_accumulation():
    from nanotron_parallel.testing import shared_default_group

    with shared_default_group():
        for scale in (1.0, 0.5, 1 / 3):
            fused, n_fused = _embedding_accumulated(True, 1, scale)
            plain, n_plain = _embedding_accumulated(False, 1, scale)
            assert torch.equal(fused, plain) and (n_fused, n_plain) == (0, 1)
            assert fused[20:].abs().sum() == 0 and fused[:20].abs().sum() > 0  # rows never used
            fused, n_fused = _embedding_accumulated(True, 3, scale)
            plain, n_plain = _embedding_accumulated(False, 3, scale)
            assert torch.allclose(fused, plain, rtol=1e-6, atol=1e-6 * plain.abs().max().item())
            assert (n_fused, n_plain) == (0, 3)


def _lm_head_accumulated(fuse: bool, micro_batches: int, grad_scale: float):
    """The fused lm_head-and-loss weight's buffer after `micro_batches` backwards (each loss
    scaled by 1/micro_batches, as the pipeline does), fused into the buffer or through
    autograd."""
    from nanotron_parallel.tensor_parallel import vocab_parallel_linear_cross_entropy

    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(40, 12) * 0.3)
    batches = [(torch.randn(32, 12), torch.randint(0, 37, (32,))) for _ in range(micro_batches)]
    dp = DataParallelGrads([weight], None, 1, 0, grad_scale=grad_scale)
    dp.zero_grad()
    for hidden, targets in batches:
        loss, _ = vocab_parallel_linear_cross_entropy(
            hidden, weight, targets, torch.full((32,), 1 / 32), None, 37, fuse_accumulation=fuse
        )
        (loss / micro_batches).backward()
    dp.finish()
    assert weight.grad is None
    return weight.main_grad.clone()


def test_fused_lm_head_gradient_equals_autograd_accumulation():
    from nanotron_parallel.testing import shared_default_group

    with shared_default_group():
        for scale in (1.0, 0.5, 1 / 3):
            fused = _lm_head_accumulated(True, 1, scale)
            plain = _lm_head_accumulated(False, 1, scale)
            assert torch.equal(fused, plain) and fused.abs().sum() > 0
            fused = _lm_head_accumulated(True, 3, scale)
            plain = _lm_head_accumulated(False, 3, scale)
            assert torch.allclose(fused, plain, rtol=1e-6, atol=1e-6 * plain.abs().max().item())


def test_tied_embedding_and_lm_head_keep_autograd():
    from nanotron_models.config import LlamaConfig
    from nanotron_models.model import LlamaStage
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=2, vocab_size=32)  # fmt: skip
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            for tied in (False, True):
                cfg = LlamaConfig(**small, tie_word_embeddings=tied)
                blocks = ["embedding", "decoder.0", "final_norm", "lm_head", "loss"]
                stage = LlamaStage(cfg, pc, blocks, "ALL_REDUCE", "sdpa", None, torch.float32)
                # tied: one weight, two uses, whose gradients autograd sums
                assert stage.embedding.fuse_grad_accumulation is not tied
                assert stage.lm_head.fuse_grad_accumulation is not tied
        finally:
            pc.destroy()
