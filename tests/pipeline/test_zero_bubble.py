"""Zero-bubble engines: their plans against the paper's figures, and one step of each on the
Llama equal to one process (zb-h1 and zbv at pp=4 and tp=2 x pp=2; zb-h1 with tied
embeddings and recompute, and under dp=2 x pp=2 ZeRO-1), in one launch of 4 processes."""

from __future__ import annotations

import pytest
import torch

from nanotron_parallel.pipeline.zb_plan import idle_formula, plan
from nanotron_parallel.testing import run_distributed
from tests.pipeline.test_llama_pipeline import SEED, SEQ, _config, _micro_batches, _reference


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_planned_idle_matches_the_paper_for_equal_costs(pp: int) -> None:
    for m in (2 * pp, 4 * pp):
        h1, v = plan("zb-h1", pp, m), plan("zbv", pp, m)
        # zb-h1: (p-1) idle slots per rank, a third of 1F1B's bubble; the paper's bubble rate
        # (idle inside a rank's span over its work) is (p-1)/3m on the first rank
        assert h1.idle_share() == pytest.approx(idle_formula("zb-h1", pp, m), abs=1e-12)
        assert h1.inner_bubble(0) == pp - 1
        assert [h1.peak_alive(r) for r in range(pp)] == [pp] * pp  # 1F1B's first-stage peak
        # zbv: no rank idles between its first and last action (the paper's zero bubble);
        # a synchronous step still waits p - 1 half-stage slots for the pipe to fill
        assert [v.inner_bubble(r) for r in range(pp)] == [0] * pp
        assert v.idle_share() == pytest.approx(idle_formula("zbv", pp, m), abs=1e-12)
        assert [v.peak_alive(r) for r in range(pp)] == [2 * pp] * pp  # 2p half-stages
        assert v.idle_share() < h1.idle_share() < idle_formula("1f1b", pp, m) / 2


def test_the_planner_prints_a_timeline() -> None:
    assert plan("zb-h1", 2, 3).timeline() == (
        "rank 0: F0 F1 .  B0 W0 F2 B1 W1 B2 W2\nrank 1: .  F0 B0 F1 B1 W0 F2 B2 W1 W2"
    )
    text = plan("zbv", 2, 3).timeline()  # chunk 1 in lower case; rank 1 turns the V locally
    assert text.splitlines()[1].startswith("rank 1: .  F0 f0 F1 f1 b0 w0")
    for m in (1, 2, 5):  # any m completes (a stall raises), pp = 1 included
        for name in ("zb-h1", "zbv"):
            for pp in (1, 2, 4):
                p = plan(name, pp, m)
                assert sum(a is not None for s in p.slots for a in s) == 3 * m * pp * p.chunks


def _zb_worker(layouts: list[tuple]) -> list[list[dict]]:
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext

    dist.init_process_group("gloo")
    pc_ref = ParallelContext(dp=dist.get_world_size())
    out = [_run_layout(pc_ref, *layout) for layout in layouts]
    pc_ref.destroy()
    dist.destroy_process_group()
    return out


def _stage(config, pc, engine: str, recompute: bool):
    """This rank's stage (zb-h1) or its two chunks in the V layout (zbv)."""
    from nanotron_models import build_llama_stage, llama_block_costs, llama_block_names
    from nanotron_parallel.pipeline import stage_block_names
    from nanotron_parallel.pipeline.zb_plan import SCHEDULES

    sched, names = SCHEDULES[engine], llama_block_names(config)
    n = pc.pp_size * sched.chunks
    costs = llama_block_costs(config, SEQ)
    chunks = []
    for c in range(sched.chunks):
        vs = sched.virtual_stage(pc.pp_rank, c, pc.pp_size)
        chunk = build_llama_stage(config, pc, stage_block_names(names, costs, n, vs), seed=SEED)
        chunk.set_recompute(recompute)
        chunks.append(chunk)
    if len(chunks) == 1:
        return chunks[0], chunks
    holder = torch.nn.ModuleList(chunks)
    holder.chunks = chunks
    return holder, chunks


def _run_layout(pc_ref, dp, tp, pp, layers, cases) -> list[dict]:
    from nanotron_models import full_state_dict
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.data_parallel import build_data_parallel
    from nanotron_parallel.pipeline import loss_on_all_pp_ranks, run_pipeline_step
    from nanotron_parallel.tied import tied_parameters

    pc = ParallelContext(dp=dp, tp=tp, pp=pp)
    out = []
    for engine, tie, recompute, zero, m in cases:
        config = _config(layers, tie)
        model, chunks = _stage(config, pc, engine, recompute)
        batches = _micro_batches(m, config.vocab_size)
        params = [p for c in chunks for p in c.parameters()]
        tied = tied_parameters(chunks[0], pc) if len(chunks) == 1 else None
        tied_ids = {id(p) for g in (tied.groups if tied else []) for p in g.params}
        grads_dp = build_data_parallel(
            zero, params, pc.dp_group, pc.dp_size, pc.dp_rank, full_reduce=tied_ids,
            tensor_collectives=True,
        )  # fmt: skip
        result = run_pipeline_step(
            engine, model, batches, pc, on_last_backward=grads_dp.arm, track_activations=True
        )
        grads_dp.finish()
        if tied is not None:
            tied.sync_gradients(grads_dp.tied_grad)
        loss = float(loss_on_all_pp_ranks(_loss_on_last(result.loss_tensor, pc, engine), pc))
        ref_loss, ref_grads = _reference(config, pc_ref, batches)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (engine, loss, ref_loss)
        worst = _compare(chunks, grads_dp, ref_grads, full_state_dict, engine)
        out.append({"case": (engine, m), "live": result.stats.peak_live_micro_batches,
                    "pp_rank": pc.pp_rank, "worst": worst})  # fmt: skip
        grads_dp.remove_hooks()
    pc.destroy()
    return out


def _loss_on_last(loss, pc, engine: str):
    """zbv computes the loss on the first rank (both ends of the V): hand it to the last."""
    import torch.distributed as dist

    if engine != "zbv" or pc.pp_size == 1:
        return loss
    value = torch.zeros((), dtype=torch.float64) if loss is None else loss.clone()
    dist.broadcast(value, src=pc.pp_ranks[0], group=pc.pp_group)
    return value if pc.is_last_stage else None


def _compare(chunks, grads_dp, ref_grads, full_state_dict, engine) -> float:
    """Each reduced gradient element this rank owns (ZeRO-1: its chunks) vs one process."""
    names = {id(p): n for c in chunks for n, p in c.named_parameters()}
    worst = 0.0
    if grads_dp.zero_stage == 0:  # every element: the full tensors (gathered over tp)
        for c in chunks:
            for p in c.parameters():
                p.grad = p.main_grad.clone()
            for name, grad in full_state_dict(c, grads=True).items():
                ref = ref_grads[name]
                worst = max(worst, float((grad - ref).abs().max() / ref.abs().max()))
    else:
        for piece in grads_dp.owned_pieces():
            ref = ref_grads[names[id(piece.param)]].reshape(-1)[piece.start : piece.end]
            worst = max(worst, float((piece.grad - ref).abs().max() / ref.abs().max()))
    assert worst <= 1e-5, (engine, worst)
    return worst


PP4 = [("zb-h1", True, True, 0, 8), ("zbv", False, False, 0, 8)]
TP2_PP2 = [("zb-h1", False, False, 0, 4), ("zbv", False, True, 0, 4)]
DP2_PP2 = [("zb-h1", True, False, 1, 4)]


def test_zero_bubble_steps_equal_one_process() -> None:
    layouts = [(1, 1, 4, 8, PP4), (1, 2, 2, 4, TP2_PP2), (2, 1, 2, 2, DP2_PP2)]
    results = run_distributed(_zb_worker, 4, layouts, timeout=300)
    for rank_results in results:
        for r in rank_results[0]:  # pp = 4: zb-h1 holds at most pp micro-batches per rank
            if r["case"][0] == "zb-h1":
                assert r["live"] == 4
        assert all(r["worst"] <= 1e-5 for layout in rank_results for r in layout)
