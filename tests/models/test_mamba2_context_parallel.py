"""Context parallel for the Mamba-2 mixer (mixers/mamba2_cp.py) in 2 and 4 gloo processes:
outputs, input gradients and every parameter's gradient (summed over the cp ranks, as the
dp x cp reduction does) equal one process's mixer on the whole sequence, in the zigzag layout
and in another chunk layout, with lengths that are not multiples of the SSD chunk size, chunks
as short as the conv's halo, and packed documents (boundaries at chunk starts and inside a
halo); the bytes the collectives move equal `cp_bytes_per_layer`, which is checked against the
formula written out here."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from nanotron_models.mixers import Mamba2Dims, Mamba2Mixer
from nanotron_models.mixers.mamba2_cp import (
    check_context_parallel,
    context_parallel_forward,
    cp_bytes_per_layer,
    local_reset_mask,
)
from nanotron_parallel import ParallelConfigError
from nanotron_parallel.context_parallel.state_passing import ChunkLayout
from nanotron_parallel.testing import run_distributed

DIMS = Mamba2Dims(
    hidden_size=32, num_heads=4, head_dim=8, n_groups=2, state_size=8, conv_kernel=4,
    chunk_size=8,
)  # fmt: skip
F64 = torch.float64
BATCH = 2
# Document starts per row, for a 40-token sequence: 10 and 35 open a chunk (cp=2: chunks of
# 10; cp=4: of 5), 29 sits in the halo the chunk [25, 30) hands on, 17..38 spans chunks.
DOC_STARTS = ((10, 17, 38), (4, 29, 35))

# (name, sequence length, dtype, documents, layout kind, native reduce-scatter)
RUNS = [
    ("plain", 40, F64, False, "zigzag", True),
    ("documents", 40, F64, True, "zigzag", True),
    ("fp32 documents", 40, torch.float32, True, "zigzag", True),
    ("gloo reduce", 40, F64, True, "zigzag", None),  # the backward's all-reduce + slice
    ("contiguous layout", 40, F64, True, "contiguous", True),
]
CP4_ONLY = [("halo-sized chunks", 24, F64, True, "zigzag", True)]  # chunks of K-1 = 3 tokens


def _layout(kind: str, cp: int) -> ChunkLayout:
    if kind == "zigzag":
        return ChunkLayout.zigzag(cp)
    return ChunkLayout(tuple((2 * r, 2 * r + 1) for r in range(cp)))


def _mixer(dtype: torch.dtype) -> Mamba2Mixer:
    """Every parameter random (A_log, D, dt_bias and the norm included), in a sane range."""
    mixer = Mamba2Mixer(DIMS, dtype=dtype)
    g = torch.Generator().manual_seed(0)
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


def _inputs(seq: int, dtype: torch.dtype, documents: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, seq, DIMS.hidden_size, generator=g, dtype=F64).to(dtype)
    w = torch.randn(BATCH, seq, DIMS.hidden_size, generator=g, dtype=F64).to(dtype)
    if not documents:
        return x, w, None
    doc_ids = torch.zeros(BATCH, seq, dtype=torch.long)
    for row, starts in enumerate(DOC_STARTS):
        for start in starts:
            doc_ids[row, start % seq :] += 1
    return x, w, doc_ids


@contextmanager
def _counting(received: dict[str, int]):
    """Count the bytes that reach this rank through the collectives state_passing runs."""
    from nanotron_parallel.context_parallel import state_passing as sp

    gather, scatter, p2p = sp._all_gather_tensor, sp._reduce_scatter_tensor, dist.batch_isend_irecv

    def counted_gather(out, inp, group=None):
        received["gather"] += (out.numel() - inp.numel()) * out.element_size()
        return gather(out, inp, group=group)

    def counted_scatter(out, inp, group=None):
        received["scatter"] += (inp.numel() - out.numel()) * out.element_size()
        return scatter(out, inp, group=group)

    def counted_p2p(ops):
        for op in ops:
            if op.op is dist.irecv:
                received["p2p"] += op.tensor.numel() * op.tensor.element_size()
        return p2p(ops)

    sp._all_gather_tensor, sp._reduce_scatter_tensor = counted_gather, counted_scatter
    dist.batch_isend_irecv = counted_p2p
    try:
        yield
    finally:
        sp._all_gather_tensor, sp._reduce_scatter_tensor, dist.batch_isend_irecv = (
            gather, scatter, p2p,
        )  # fmt: skip


def _run(run, cp: int, rank: int) -> dict:
    _, seq, dtype, documents, kind, native = run
    layout = _layout(kind, cp)
    mixer = _mixer(dtype)
    x, w, doc_ids = _inputs(seq, dtype, documents)
    mine = layout.split(x, 1, rank).requires_grad_()
    reset = None if doc_ids is None else local_reset_mask(doc_ids, rank, cp, layout)
    fwd = {"gather": 0, "scatter": 0, "p2p": 0}
    bwd = dict(fwd)
    with _counting(fwd):
        out = context_parallel_forward(mixer, mine, None, reset, layout, native)
    with _counting(bwd):
        (out * layout.split(w, 1, rank)).sum().backward()
    return {
        "out": out.detach(),
        "grad_x": mine.grad,
        "grads": {n: p.grad for n, p in mixer.named_parameters()},
        "forward_bytes": fwd,
        "backward_bytes": bwd,
    }


def cp_worker(runs: list) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    results = [_run(run, cp, rank) for run in runs]
    try:  # chunks of 2 tokens < conv_kernel - 1: refused in one line
        _run(("short", 4 * cp, F64, False, "zigzag", True), cp, rank)
        results.append({"refusal": None})
    except ParallelConfigError as err:
        results.append({"refusal": str(err)})
    dist.destroy_process_group()
    return results


def _reference(run) -> dict:
    _, seq, dtype, documents, _, _ = run
    mixer = _mixer(dtype)
    x, w, doc_ids = _inputs(seq, dtype, documents)
    x.requires_grad_()
    reset = None if doc_ids is None else local_reset_mask(doc_ids, 0, 1)
    out = mixer(x, reset)
    (out * w).sum().backward()
    return {"out": out.detach(), "grad_x": x.grad, "grads": dict(mixer.named_parameters())}


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel}"


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_mixer_equals_one_process(cp: int) -> None:
    runs = RUNS + (CP4_ONLY if cp == 4 else [])
    by_rank = run_distributed(cp_worker, cp, runs, timeout=120)
    for i, run in enumerate(runs):
        name, seq, dtype, documents, kind, _ = run
        rel = 1e-5 if dtype == torch.float32 else 1e-11
        ref = _reference(run)
        layout = _layout(kind, cp)
        for rank in range(cp):
            res = by_rank[rank][i]
            _close(res["out"], layout.split(ref["out"], 1, rank), rel, f"{name} rank {rank} out")
            _close(res["grad_x"], layout.split(ref["grad_x"], 1, rank), rel, f"{name} dx")
            for way in ("forward_bytes", "backward_bytes"):
                back = way == "backward_bytes"
                expected = cp_bytes_per_layer(DIMS, BATCH, rank, cp, dtype, layout, back)
                got = res[way]
                assert got["p2p"] == expected.halo, (name, rank, way, got)
                states = got["gather"] if way == "forward_bytes" else got["scatter"]
                if run[5] is True or way == "forward_bytes":  # gloo's default: an all-reduce
                    assert states == expected.states, (name, rank, way, got)
        for pname, param in ref["grads"].items():
            summed = sum(by_rank[rank][i]["grads"][pname] for rank in range(cp))
            _close(summed, param.grad, rel, f"{name} d{pname}")
    for rank in range(cp):
        refusal = by_rank[rank][-1]["refusal"]
        assert refusal is not None and "shorter than conv_kernel - 1 = 3" in refusal
        assert "\n" not in refusal


def test_bytes_formula_and_refusals() -> None:
    """cp_bytes_per_layer against the formula written out: per rank and layer, each way,
    halo = (chunks whose predecessor is on another rank) * b * conv_dim * (K-1) * e_act and
    states = (cp-1) * 2 * b * H * (P*N + 1) * e_state (fp32 states for bf16 activations)."""
    big = Mamba2Dims(2560, 80, 64, 1, 128, conv_kernel=4)  # Mamba-2 2.7B's mixer
    conv_dim = 80 * 64 + 2 * 128
    for cp, rank, received in ((2, 0, 1), (4, 0, 1), (4, 1, 2), (4, 3, 1), (8, 5, 2)):
        got = cp_bytes_per_layer(big, 1, rank, cp, torch.bfloat16)
        assert got.halo == received * 1 * conv_dim * 3 * 2
        assert got.states == (cp - 1) * 2 * 1 * 80 * (64 * 128 + 1) * 4
    assert cp_bytes_per_layer(big, 1, 0, 4, torch.bfloat16).total == 32_256 + 15_730_560
    check_context_parallel(DIMS, 12, 2)  # chunks of 3 = K-1: fine
    with pytest.raises(ParallelConfigError, match="not divisible by the 4 chunks of cp=2"):
        check_context_parallel(DIMS, 10, 2)
    with pytest.raises(ParallelConfigError, match="chunks of 2 tokens"):
        check_context_parallel(DIMS, 16, 4)


def test_layout_split_and_tails() -> None:
    zig = ChunkLayout.zigzag(4)
    assert zig.ranks == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert [zig.tails_received(r) for r in range(4)] == [[7], [1, 6], [2, 5], [3]]
    assert zig.sequence_order == (0, 2, 4, 6, 7, 5, 3, 1)
    assert zig.rank_order == (0, 7, 1, 6, 2, 5, 3, 4)
    x = torch.arange(16)[None]
    from nanotron_parallel.context_parallel import split_sequence

    assert all(torch.equal(zig.split(x, 1, r), split_sequence(x, 1, r, 4)) for r in range(4))
    with pytest.raises(ValueError, match="every chunk once"):
        ChunkLayout(((0, 1), (1, 2)))
