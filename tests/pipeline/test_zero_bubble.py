"""Zero-bubble engines: their plans against the paper's figures, and the cases of one step of
each on the Llama equal to one process (zb-h1 and zbv at pp=4 and tp=2 x pp=2; zb-h1 with
tied embeddings and recompute, and under dp=2 x pp=2 ZeRO-1). The cases run inside
test_llama_pipeline's launch (`run_zb_cases`, `ZB_CASES`), which checks them: one launch of
processes and groups serves every engine."""

from __future__ import annotations

import pytest
import torch

from nanotron_parallel.pipeline.zb_plan import idle_formula, plan


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
        # held to 1F1B's p - r on every stage: 2(p-1) idle slots per rank, 2/3 of 1F1B's
        low = plan("zb-h1-stage-memory", pp, m)
        assert [low.peak_alive(r) for r in range(pp)] == [pp - r for r in range(pp)]
        assert low.idle_share() == pytest.approx(
            idle_formula("zb-h1-stage-memory", pp, m), abs=1e-12
        )
        assert h1.idle_share() < low.idle_share() < idle_formula("1f1b", pp, m)


def test_the_planner_prints_a_timeline() -> None:
    assert plan("zb-h1", 2, 3).timeline() == (
        "rank 0: F0 F1 .  B0 W0 F2 B1 W1 B2 W2\nrank 1: .  F0 B0 F1 B1 W0 F2 B2 W1 W2"
    )
    text = plan("zbv", 2, 3).timeline()  # chunk 1 in lower case; rank 1 turns the V locally
    assert text.splitlines()[1].startswith("rank 1: .  F0 f0 F1 f1 b0 w0")
    for m in (1, 2, 5):  # any m completes (a stall raises), pp = 1 included
        for name in ("zb-h1", "zbv", "zb-h1-stage-memory"):
            for pp in (1, 2, 4):
                p = plan(name, pp, m)
                assert sum(a is not None for s in p.slots for a in s) == 3 * m * pp * p.chunks


def _stage(config, pc, engine: str, recompute: bool):
    """This rank's stage (zb-h1) or its two chunks in the V layout (zbv)."""
    from nanotron_models import build_llama_stage, llama_block_costs, llama_block_names
    from nanotron_parallel.pipeline import stage_block_names
    from nanotron_parallel.pipeline.zb_plan import SCHEDULES
    from tests.pipeline.test_llama_pipeline import SEED, SEQ

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


def run_zb_cases(pc, pc_ref, cases) -> list[dict]:
    """Each case (engine, layers, tie, recompute, zero_stage, m): one step on fresh chunks
    under data parallelism (ZeRO as asked), the loss and every owned gradient element checked
    against one process (`pc_ref`) on this rank."""
    from nanotron_models import full_state_dict
    from nanotron_parallel.data_parallel import build_data_parallel
    from nanotron_parallel.pipeline import engine as pipeline_engine
    from nanotron_parallel.pipeline import loss_on_all_pp_ranks, run_pipeline_step
    from nanotron_parallel.tied import tied_parameters
    from tests.pipeline.test_llama_pipeline import _config, _micro_batches, _reference

    out = []
    for engine, layers, tie, recompute, zero, m in cases:
        config = _config(layers, tie)
        model, chunks = _stage(config, pc, engine, recompute)
        batches = _micro_batches(m, config.vocab_size)
        params = [p for c in chunks for p in c.parameters()]
        apart = pipeline_engine(engine).last_stage_rank(pc.pp_size, len(chunks)) != 0
        tied = tied_parameters(chunks[0], pc, apart) if len(chunks) == 1 else None
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
        # every engine leaves the loss on the last stage (zbv hands it over from rank 0)
        assert (result.loss_tensor is not None) == pc.is_last_stage, engine
        loss = float(loss_on_all_pp_ranks(result.loss_tensor, pc))
        ref_loss, ref_grads = _reference(config, pc_ref, batches)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (engine, loss, ref_loss)
        worst = _compare(chunks, grads_dp, ref_grads, full_state_dict, engine)
        out.append({"case": (engine, m), "live": result.stats.peak_live_micro_batches,
                    "pp_rank": pc.pp_rank, "worst": worst})  # fmt: skip
        grads_dp.remove_hooks()
    return out


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


# (engine, layers, tie, recompute, zero_stage, m) by layout of test_llama_pipeline's launch
ZB_CASES = {
    "pp4": [("zb-h1", 8, True, True, 0, 8), ("zbv", 8, False, False, 0, 8)],
    "tp2_pp2": [("zb-h1", 4, False, False, 0, 4), ("zbv", 4, False, True, 0, 4)],
    "dp2_pp2": [("zb-h1", 4, True, False, 1, 4)],  # ZeRO-1 over dp=2, tied embedding
}


def check_zb_results(pp4: list[list[dict]]) -> None:
    """Every case passed its checks on every rank; at pp=4, m=8 zb-h1 holds pp micro-batches
    on every rank (the paper's ZB-H1: 1F1B's first-stage peak)."""
    for rank_results in pp4:
        for r in rank_results:
            assert r["worst"] <= 1e-5, r
            if r["case"] == ("zb-h1", 8):
                assert r["live"] == 4, r
