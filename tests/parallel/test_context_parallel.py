"""Context parallel pieces: the chunk layout and positions (pure), and the attention function
in 2 and 4 gloo processes against full causal attention in one process, values and gradients,
with grouped-query heads."""

from __future__ import annotations

import os

import pytest
import torch

from nanotron_parallel import ParallelConfigError
from nanotron_parallel.context_parallel import (
    LABEL_COUNT_KEY,
    chunk_ids,
    local_positions,
    split_batch,
    split_sequence,
)
from nanotron_parallel.testing import run_distributed, shared_default_group


def test_chunks_pair_each_with_its_mirror() -> None:
    assert [chunk_ids(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # Causal work per rank (keys seen, in chunks) is the same on every rank: 2*cp + 1.
    for cp in (2, 3, 4):
        assert {sum(c + 1 for c in chunk_ids(r, cp)) for r in range(cp)} == {2 * cp + 1}


def test_positions_and_split_cover_the_sequence_once() -> None:
    assert local_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4):
        x = torch.arange(3 * 24).view(3, 24)
        parts = [split_sequence(x, 1, r, cp) for r in range(cp)]
        assert all(p.shape == (3, 24 // cp) for p in parts)
        positions = torch.cat([local_positions(24, r, cp) for r in range(cp)])
        assert sorted(positions.tolist()) == list(range(24))
        # A part holds exactly the tokens at its positions.
        for r, part in enumerate(parts):
            assert torch.equal(part, x[:, local_positions(24, r, cp)])
    with pytest.raises(ParallelConfigError, match="not divisible by 2\\*cp = 4"):
        split_sequence(torch.zeros(2, 10), 1, 0, 2)


def test_split_batch_slices_tokens_and_counts_labels() -> None:
    ids = torch.arange(2 * 8).view(2, 8)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, :3] = False
    batch = {"input_ids": ids, "label_ids": ids + 100, "label_mask": mask}
    assert split_batch(batch, 0, 1) is batch
    part = split_batch(batch, 1, 2)  # chunks 1 and 2 of 4 (positions 2..5)
    assert part["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part["label_ids"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert part["label_mask"].tolist() == [[False, True, True, True], [True] * 4]
    assert part["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert float(part[LABEL_COUNT_KEY]) == 13.0  # the whole micro-batch's labelled tokens
    # position_ids given by the data (restarting at documents) are sliced, not replaced
    given = split_batch({**batch, "position_ids": ids % 5}, 0, 2)
    assert given["position_ids"].tolist() == [[0, 1, 1, 2], [3, 4, 4, 0]]


def _sdpa_kernel(q, k, v, q_index=None, k_index=None):
    """The model's mask-free kernel (bottom-right causal sdpa), under the index contract."""
    from nanotron_models.attention import attention

    return attention(q, k, v, "sdpa")


SEQ, BATCH, HEADS, KV_HEADS = 16, 2, 8, 2
# Document starts per row (each crosses some cp=4 chunk boundary: chunks of 2 tokens) and a
# sliding window of 5 keys: the masks of the unit test, as functions of global positions.
DOC_STARTS = ((0, 5, 11), (0, 3, 9, 14))
WINDOW = 5


def _mask_fn(case: str):
    """None (causal only), or the model-side mask of `case` by global positions."""
    if case == "causal":
        return None
    if case == "window":
        return lambda qi, ki: (qi[:, None] - ki[None, :]) < WINDOW
    docs = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for row, starts in enumerate(DOC_STARTS):
        for start in starts:
            docs[row, start:] += 1
    return lambda qi, ki: (docs[:, qi][:, :, None] == docs[:, ki][:, None, :])[:, None]


def _kernel(case: str):
    from nanotron_parallel.context_parallel import reference_kernel

    return _sdpa_kernel if case == "causal" else reference_kernel(_mask_fn(case))


def _full_inputs(seq: int, heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(seq, BATCH, heads, 8, generator=g, dtype=torch.float64)
    k = torch.randn(seq, BATCH, kv_heads, 8, generator=g, dtype=torch.float64)
    v = torch.randn(seq, BATCH, kv_heads, 8, generator=g, dtype=torch.float64)
    grad_out = torch.randn(seq, BATCH, heads, 8, generator=g, dtype=torch.float64)
    return q, k, v, grad_out


ATTENTION_RUNS = [
    (method, case, native)
    for case in ("causal", "documents", "window")
    for method, native in (("allgather", False), ("allgather", True), ("ring", None), ("ulysses", None))
]  # fmt: skip


def attention_worker() -> dict:
    """This rank's outputs and gradients for every (method, mask case, native reduce-scatter),
    and the saved-activation bytes of `saved_bytes` (one launch for both tests)."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.context_parallel import context_parallel_attention

    torch.set_num_threads(1)
    with shared_default_group():  # one default group for every context
        pc = ParallelContext(cp=int(os.environ["WORLD_SIZE"]))
        runs = []
        try:
            for method, case, native in ATTENTION_RUNS:
                q, k, v, grad_out = _full_inputs(SEQ, HEADS, KV_HEADS)
                mine = [
                    split_sequence(t, 0, pc.cp_rank, pc.cp_size).requires_grad_() for t in (q, k, v)
                ]
                out = context_parallel_attention(
                    *mine, pc.cp_group, _kernel(case), native, method=method,
                    mask_fn=_mask_fn(case),
                )  # fmt: skip
                out.backward(split_sequence(grad_out, 0, pc.cp_rank, pc.cp_size))
                runs.append({"out": out.detach(), "grads": [t.grad for t in mine]})
            attention_saved = {m: attention_saved_bytes(pc, m) for m in ("allgather", "ring")}
        finally:
            pc.destroy()
        model = {m: model_saved_bytes(256, m) for m in ("allgather", "ring", "ulysses")}
    return {"runs": runs, "attention_saved": attention_saved, "model_saved": model}


@pytest.fixture(scope="module")
def cp4_results() -> list[dict]:
    return run_distributed(attention_worker, 4, timeout=180)


def test_attentions_match_full_attention(cp4_results) -> None:
    """At cp=4: all-gather (gloo's and NCCL's reduce-scatter), ring and Ulysses attention give
    the values and q/k/v gradients of one process's full attention (fp64, 8 query heads on 2
    kv heads: Ulysses repeats each kv head), causal, with documents crossing the chunk
    boundaries, and with a sliding window (ring blocks with rows that see no key); ring and
    Ulysses equal the all-gather within 1e-6 (they agree to ~1e-15)."""
    from nanotron_parallel.context_parallel import reference_attention

    results = [r["runs"] for r in cp4_results]
    q, k, v, grad_out = _full_inputs(SEQ, HEADS, KV_HEADS)
    index = torch.arange(SEQ)
    refs = {}
    for case in ("causal", "documents", "window"):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*full, index, index, _mask_fn(case))[0]
        ref.backward(grad_out)
        refs[case] = (ref.detach(), [t.grad for t in full])
    assert not torch.allclose(refs["causal"][0], refs["documents"][0])  # the masks bite
    assert not torch.allclose(refs["causal"][0], refs["window"][0])
    for rank, rank_runs in enumerate(results):
        pos = local_positions(SEQ, rank, 4)
        by_run = dict(zip(ATTENTION_RUNS, rank_runs, strict=True))
        for (_method, case, _native), res in by_run.items():
            ref_out, ref_grads = refs[case]
            torch.testing.assert_close(res["out"], ref_out[pos], rtol=1e-10, atol=1e-10)
            for got, want in zip(res["grads"], ref_grads, strict=True):
                torch.testing.assert_close(got, want[pos], rtol=1e-10, atol=1e-10)
            base = by_run[("allgather", case, False)]
            assert (res["out"] - base["out"]).abs().max() <= 1e-6
            for got, want in zip(res["grads"], base["grads"], strict=True):
                assert (got - want).abs().max() <= 1e-6


def model_saved_bytes(seq: int, method: str = "allgather") -> int:
    """Bytes a small Llama's forward saves for backward on this rank (cp = world size)."""
    from nanotron_models.config import LlamaConfig
    from nanotron_models.model import build_llama
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.pipeline.step import ActivationTracker

    pc = ParallelContext(cp=int(os.environ.get("WORLD_SIZE", "1")))
    try:
        config = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=seq,
        )  # fmt: skip
        stage = build_llama(config, pc, seed=1)
        stage.set_context_parallel(pc.cp_group, pc.cp_size, None, method)
        ids = torch.randint(0, 128, (1, seq + 1), generator=torch.Generator().manual_seed(2))
        batch = {"input_ids": ids[:, :-1], "label_ids": ids[:, 1:]}
        batch["label_mask"] = torch.ones(1, seq, dtype=torch.bool)
        tracker = ActivationTracker(stage, measure_bytes=True)
        tracker.forward(stage, None, split_batch(batch, pc.cp_rank, pc.cp_size), 0).backward()
        return tracker.stats.peak_saved_activation_bytes
    finally:
        pc.destroy()


def attention_saved_bytes(pc, method: str) -> dict:
    """Bytes autograd keeps for this rank's cp attention (fp64, causal), and the bytes of its
    local q, k, v and of its output with its log-sum-exp."""
    from nanotron_parallel.context_parallel import context_parallel_attention

    saved: list[int] = []

    def pack(t: torch.Tensor):
        saved.append(t.numel() * t.element_size())
        return t

    q, k, v, _ = _full_inputs(SEQ, HEADS, KV_HEADS)
    mine = [split_sequence(t, 0, pc.cp_rank, pc.cp_size).requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = context_parallel_attention(*mine, pc.cp_group, _sdpa_kernel, method=method)
    lse = out.shape[0] * out.shape[1] * out.shape[2] * 8  # [b, h, 2C] fp64
    return {
        "saved": sum(saved),
        "local_qkv": sum(t.numel() * 8 for t in mine),
        "out_lse": out.numel() * 8 + lse,
    }


def test_saved_activations_scale_as_one_over_cp(monkeypatch, cp4_results) -> None:
    """The all-gather keeps this rank's q, k, v and nothing of the gathered K/V, the ring
    those and its output with its log-sum-exp; the whole model's saved activations per rank
    at cp=4 are at most 1/4 + 10% of cp=1's with each choice (bench/cp_memory.py prints the
    same measure at cp=2 and 4 on a longer sequence)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    one = model_saved_bytes(256)
    for res in cp4_results:
        gather, ring = res["attention_saved"]["allgather"], res["attention_saved"]["ring"]
        assert gather["saved"] == gather["local_qkv"] > 0
        assert ring["saved"] == ring["local_qkv"] + ring["out_lse"]
    for method in ("allgather", "ring", "ulysses"):
        four = max(res["model_saved"][method] for res in cp4_results)
        assert 0 < four <= (0.25 + 0.1) * one, (method, four, one)


def test_inference_refuses_a_context_parallel_model(monkeypatch) -> None:
    """`logits` (generation, evaluation) runs whole sequences, so a model set up for context
    parallel is refused there in one line instead of attending over a wrong split."""
    from nanotron_models.config import LlamaConfig, ModelConfigError
    from nanotron_models.model import build_llama
    from nanotron_parallel.context import ParallelContext

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    pc = ParallelContext()
    try:
        config = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64, max_position_embeddings=16,
        )  # fmt: skip
        stage = build_llama(config, pc, seed=1)
        assert stage.logits(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 64)
        stage.set_context_parallel(pc.cp_group, 2)
        with pytest.raises(ModelConfigError, match="without context parallel"):
            stage.logits(torch.zeros(1, 4, dtype=torch.long))
    finally:
        pc.destroy()
