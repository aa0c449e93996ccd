"""The Gated DeltaNet mixer across processes, in ONE launch of 4 gloo processes: context
parallel at cp=4 (the whole world) and cp=2 (two pairs), tensor parallel at tp=2, and tp=2 x
cp=2. Outputs, input gradients and every parameter's gradient (summed over the cp ranks, as
the dp x cp reduction does; sliced by the tp plan) equal one process's mixer on the whole
sequence, in the zigzag layout, with lengths that are not multiples of the delta rule's chunk,
and packed documents (boundaries at chunk starts and inside a halo). The bytes the cp
collectives move equal `cp_bytes_per_layer`, checked against the formula written out here."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from nanotron_models.mixers.gated_deltanet import GatedDeltaNetDims, GatedDeltaNetMixer
from nanotron_models.mixers.gated_deltanet_cp import (
    check_context_parallel,
    context_parallel_mix,
    cp_bytes_per_layer,
    local_reset_mask,
)
from nanotron_models.mixers.gated_deltanet_tp import shard_gated_deltanet
from nanotron_models.mixers.ssd_scan import reset_mask_from_document_ids
from nanotron_parallel import ParallelConfigError
from nanotron_parallel.context_parallel.state_passing import ChunkLayout
from nanotron_parallel.testing import run_distributed

DIMS = GatedDeltaNetDims(
    hidden_size=32, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6,
    conv_kernel=4, chunk_size=8,
)  # fmt: skip
F64 = torch.float64
BATCH = 2
# Document starts per row and length. 40 tokens (cp=4: chunks of 5; cp=2: of 10): 10 and 35
# open a chunk, 29 sits in the halo the chunk [25, 30) hands on. 44 (cp=2: chunks of 11): 33
# opens a chunk, 30 sits in the halo of [22, 33).
DOC_STARTS = {40: ((10, 17, 38), (4, 29, 35)), 44: ((11, 17, 38), (4, 30, 33))}

# (name, cp, tp, sequence length, dtype, documents)
RUNS = [
    ("cp4", 4, 1, 40, F64, False),
    ("cp4 documents", 4, 1, 40, F64, True),
    ("cp4 fp32 documents", 4, 1, 40, torch.float32, True),
    ("cp2 documents", 2, 1, 44, F64, True),
    ("tp2", 1, 2, 21, F64, True),
    ("tp2 x cp2 documents", 2, 2, 40, F64, True),
]


def _mixer(dims: GatedDeltaNetDims, dtype: torch.dtype) -> GatedDeltaNetMixer:
    """Every parameter random (A_log, dt_bias and the norm included), in a sane range."""
    mixer = GatedDeltaNetMixer(dims, dtype=dtype)
    g = torch.Generator().manual_seed(0)
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


def _inputs(seq: int, dtype: torch.dtype, documents: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, seq, DIMS.hidden_size, generator=g, dtype=F64).to(dtype)
    w = torch.randn(BATCH, seq, DIMS.hidden_size, generator=g, dtype=F64).to(dtype)
    doc_ids = torch.zeros(BATCH, seq, dtype=torch.long)
    for row, starts in enumerate(DOC_STARTS.get(seq, ((5, 13), (8,))) if documents else ()):
        for start in starts:
            doc_ids[row, start:] += 1
    return x, w, doc_ids if documents else None


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
        received["p2p"] += sum(
            op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.irecv
        )
        return p2p(ops)

    sp._all_gather_tensor, sp._reduce_scatter_tensor = counted_gather, counted_scatter
    dist.batch_isend_irecv = counted_p2p
    try:
        yield
    finally:
        sp._all_gather_tensor, sp._reduce_scatter_tensor = gather, scatter
        dist.batch_isend_irecv = p2p


def _grid(groups: dict, cp: int, tp: int, rank: int):
    """(cp group, cp rank, tp rank) of this rank for a run: tp fastest, as ParallelContext."""
    if cp == 4:
        return None, rank, 0
    if cp == 1:  # tp=2 over the pairs {0, 1} and {2, 3}
        return None, 0, rank % 2
    if tp == 1:  # cp=2 over the pairs {0, 1} and {2, 3}
        return groups["pairs"][rank // 2], rank % 2, 0
    return groups["strided"][rank % 2], rank // 2, rank % 2  # tp pairs {0,1}, cp pairs {0,2}


def _run(run, groups: dict, rank: int) -> dict:
    _, cp, tp, seq, dtype, documents = run
    cp_group, cp_rank, tp_rank = _grid(groups, cp, tp, rank)
    full = _mixer(DIMS, dtype)
    mixer = GatedDeltaNetMixer(DIMS.tp_local(tp), dtype=dtype)
    mixer.load_state_dict(shard_gated_deltanet(full.state_dict(), DIMS, tp, tp_rank))
    x, w, doc_ids = _inputs(seq, dtype, documents)
    layout = ChunkLayout.zigzag(cp)
    mine = (layout.split(x, 1, cp_rank) if cp > 1 else x).requires_grad_()
    counts = {"gather": 0, "scatter": 0, "p2p": 0}, {"gather": 0, "scatter": 0, "p2p": 0}
    with _counting(counts[0]):
        if cp > 1:
            reset = None if doc_ids is None else local_reset_mask(doc_ids, cp_rank, cp)
            mixed = context_parallel_mix(mixer, mine, cp_group, reset, native_reduce_scatter=True)
        else:
            reset = None if doc_ids is None else reset_mask_from_document_ids(doc_ids)
            mixed = mixer.mix(mine, reset)[0]
        out = mixer.out_proj(mixed)  # row-parallel: the tp ranks' partial outputs sum
    with _counting(counts[1]):
        (out * (layout.split(w, 1, cp_rank) if cp > 1 else w)).sum().backward()
    return {
        "out": out.detach(),
        "grad_x": mine.grad,
        "grads": {n: p.grad for n, p in mixer.named_parameters()},
        "bytes": counts,
        "cp_rank": cp_rank,
        "tp_rank": tp_rank,
    }


def worker(runs: list) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {  # every rank makes every group, in the same order
        "pairs": [dist.new_group([0, 1]), dist.new_group([2, 3])],
        "strided": [dist.new_group([0, 2]), dist.new_group([1, 3])],
    }
    results = [_run(run, groups, rank) for run in runs]
    try:  # chunks of 1 token < conv_kernel - 1: refused in one line
        _run(("short", 4, 1, 8, F64, False), groups, rank)
        results.append({"refusal": None})
    except ParallelConfigError as err:
        results.append({"refusal": str(err)})
    dist.destroy_process_group()
    return results


def _reference(run) -> dict:
    _, _, _, seq, dtype, documents = run
    mixer = _mixer(DIMS, dtype)
    x, w, doc_ids = _inputs(seq, dtype, documents)
    x.requires_grad_()
    reset = None if doc_ids is None else reset_mask_from_document_ids(doc_ids)
    out = mixer(x, reset)
    (out * w).sum().backward()
    grads = {n: p.grad for n, p in mixer.named_parameters()}
    return {"out": out.detach(), "grad_x": x.grad, "grads": grads}


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel}"


@pytest.fixture(scope="module")
def by_rank() -> list[list[dict]]:
    return run_distributed(worker, 4, RUNS, timeout=180)


@pytest.mark.parametrize("index", range(len(RUNS)), ids=[r[0] for r in RUNS])
def test_equals_one_process(by_rank, index: int) -> None:
    name, cp, tp, _, dtype, _ = run = RUNS[index]
    rel = 1e-5 if dtype == torch.float32 else 1e-11
    ref = _reference(run)
    layout = ChunkLayout.zigzag(cp)
    results = [by_rank[r][index] for r in range(cp * tp)]  # one replica of the run
    for cp_rank in range(cp):
        mine = [res for res in results if res["cp_rank"] == cp_rank]
        want = layout.split(ref["out"], 1, cp_rank) if cp > 1 else ref["out"]
        _close(sum(res["out"] for res in mine), want, rel, f"{name} cp rank {cp_rank} out")
        want = layout.split(ref["grad_x"], 1, cp_rank) if cp > 1 else ref["grad_x"]
        _close(sum(res["grad_x"] for res in mine), want, rel, f"{name} dx")
    for tp_rank in range(tp):
        expected = shard_gated_deltanet(ref["grads"], DIMS, tp, tp_rank)
        for pname, grad in expected.items():
            holders = [
                res for res in results if res["tp_rank"] == tp_rank or pname == "norm.weight"
            ]
            _close(sum(res["grads"][pname] for res in holders), grad, rel, f"{name} d{pname}")
    for res in results if cp > 1 else ():
        expected = [
            cp_bytes_per_layer(DIMS.tp_local(tp), BATCH, res["cp_rank"], cp, dtype, None, back)
            for back in (False, True)
        ]
        forward, backward = res["bytes"]
        assert (forward["p2p"], forward["gather"]) == (expected[0].halo, expected[0].states)
        assert (backward["p2p"], backward["scatter"]) == (expected[1].halo, expected[1].states)


def test_short_chunks_refused(by_rank) -> None:
    for rank in range(4):
        refusal = by_rank[rank][-1]["refusal"]
        assert refusal is not None and "shorter than conv_kernel - 1 = 3" in refusal
        assert "\n" not in refusal


def test_bytes_formula_and_refusals() -> None:
    """cp_bytes_per_layer against the formula written out: per rank and layer, each way,
    halo = (chunks whose predecessor is on another rank) * b * (2 H_k d_k + H_v d_v) * (K-1) *
    e_act, states = (cp-1) * 2 * b * H_v * d_k * (d_v + d_k) * e_state (fp32 for bf16)."""
    big = GatedDeltaNetDims(2048, 16, 32, 128, 128, conv_kernel=4)  # Qwen3-Next-80B's mixer
    conv_dim = 2 * 16 * 128 + 32 * 128
    for cp, rank, received in ((2, 0, 1), (4, 0, 1), (4, 1, 2), (4, 3, 1), (8, 5, 2)):
        got = cp_bytes_per_layer(big, 1, rank, cp, torch.bfloat16)
        assert got.halo == received * 1 * conv_dim * 3 * 2
        assert got.states == (cp - 1) * 2 * 1 * 32 * 128 * (128 + 128) * 4
    assert cp_bytes_per_layer(big, 1, 0, 4, torch.bfloat16).total == 49_152 + 25_165_824
    check_context_parallel(DIMS, 12, 2)  # chunks of 3 = K-1: fine
    with pytest.raises(ParallelConfigError, match="not divisible by the 4 chunks of cp=2"):
        check_context_parallel(DIMS, 10, 2)
