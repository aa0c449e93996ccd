"""The Llama cut into pipeline stages (with and without tp) trains the same step as one process.

Each rank builds its stage with build_llama_stage and the whole model with build_llama from the
same seed (initialisation is topology-independent), runs one pipeline step, syncs the tied
gradients, and compares the mean loss and every parameter's full gradient with the whole model's
gradient accumulation over the same micro-batches. The zero-bubble engines' cases
(tests/pipeline/test_zero_bubble.py) run in the same launch, on the same layouts.
"""

from __future__ import annotations

import torch

from nanotron_parallel.testing import run_distributed

SEED = 1234
SEQ, MICRO_BATCH = 8, 2


def _config(layers: int, tie: bool):
    from nanotron_models import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=67,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tie,
        attn_backend="sdpa",
    )


def _micro_batches(m: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(99)
    out = []
    for _ in range(m):
        ids = torch.randint(0, vocab, (MICRO_BATCH, SEQ + 1), generator=gen)
        mask = torch.rand(MICRO_BATCH, SEQ, generator=gen) > 0.3
        mask[:, 0] = True  # every micro-batch has tokens to score
        out.append({"input_ids": ids[:, :-1], "label_ids": ids[:, 1:], "label_mask": mask})
    return out


def _reference(config, pc_ref, micro_batches) -> tuple[float, dict[str, torch.Tensor]]:
    from nanotron_models import build_llama, full_state_dict

    model = build_llama(config, pc_ref, seed=SEED)
    losses = []
    for batch in micro_batches:
        loss = model(None, batch)
        (loss / len(micro_batches)).backward()
        losses.append(loss.item())
    return sum(losses) / len(losses), full_state_dict(model, grads=True)


def _llama_worker(layouts: list[tuple]) -> list[list[dict]]:
    """Each layout (dp, tp, pp, layers, cases, zero-bubble cases) in turn on the same processes
    (one default group, so one launch covers every layout); returns each layout's results."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from tests.pipeline.test_zero_bubble import run_zb_cases

    dist.init_process_group("gloo")
    pc_ref = ParallelContext(dp=dist.get_world_size())  # the whole model on every process
    out = []
    for dp, tp, pp, layers, cases, zb_cases in layouts:
        pc = ParallelContext(dp=dp, tp=tp, pp=pp)
        out.append(_run_layout(pc, pc_ref, layers, cases) + run_zb_cases(pc, pc_ref, zb_cases))
        pc.destroy()
    pc_ref.destroy()
    dist.destroy_process_group()
    return out


def _run_layout(pc, pc_ref, layers: int, cases: list[tuple]) -> list[dict]:
    """Each case (engine, tie, tp_mode, m): one step on a fresh stage, checked on this rank."""
    from nanotron_models import (
        build_llama_stage,
        full_state_dict,
        llama_block_costs,
        llama_block_names,
    )
    from nanotron_parallel.pipeline import (
        loss_on_all_pp_ranks,
        run_pipeline_step,
        stage_block_names,
    )
    from nanotron_parallel.tied import sync_tied_gradients, tied_copies_equal

    pp = pc.pp_size
    out = []
    for engine, tie, tp_mode, m in cases:
        config = _config(layers, tie)
        names = stage_block_names(
            llama_block_names(config), llama_block_costs(config, SEQ), pp, pc.pp_rank
        )
        stage = build_llama_stage(config, pc, names, tp_mode=tp_mode, seed=SEED)
        batches = _micro_batches(m, config.vocab_size)
        result = run_pipeline_step(engine, stage, batches, pc, track_activations=True)
        sync_tied_gradients(stage, pc)
        loss = float(loss_on_all_pp_ranks(result.loss_tensor, pc))
        grads = full_state_dict(stage, grads=True)

        ref_loss, ref_grads = _reference(config, pc_ref, batches)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (engine, tie, loss, ref_loss)
        worst = 0.0
        for name, grad in grads.items():
            ref = ref_grads[name]
            err = float((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
            assert err <= 1e-5, (engine, tie, tp_mode, name, err)
            worst = max(worst, err)
        with torch.no_grad():  # an SGD step keeps tied copies bitwise equal across stages
            for p in stage.parameters():
                p -= 0.5 * p.grad
        assert tied_copies_equal(stage, pc)
        out.append(
            {
                "case": (engine, tie, tp_mode, m),
                "pp_rank": pc.pp_rank,
                "names": names,
                "n_grads": len(grads),
                "worst_rel_err": worst,
                "live": result.stats.peak_live_micro_batches,
                "bytes": result.stats.peak_saved_activation_bytes,
            }
        )
    return out


def _check(results: list[list[dict]], pp: int, layers: int) -> None:
    n_params = {}
    for rank_results in results:
        for r in rank_results:
            engine, tie, _mode, m = r["case"]
            assert r["live"] == (m if engine == "afab" else min(pp - r["pp_rank"], m))
            assert any(n.startswith("decoder.") for n in r["names"])  # every stage has a layer
            n_params[(r["case"], r["pp_rank"])] = r["n_grads"]
    # The stages together hold every parameter: 6 per layer, embedding, final norm, lm_head.
    for case in {c for c, _ in n_params}:
        total = sum(v for (c, _), v in n_params.items() if c == case)
        assert total == layers * 6 + 3, (case, total)


PP4 = [(e, tie, "ALL_REDUCE", 8) for e in ("afab", "1f1b") for tie in (False, True)] + [
    ("1f1b", True, "ALL_REDUCE", 2)  # fewer micro-batches than stages
]
PP2_TP2 = [
    ("afab", False, "ALL_REDUCE", 4),
    ("1f1b", True, "REDUCE_SCATTER", 4),
    ("afab", True, "REDUCE_SCATTER", 3),
    ("1f1b", False, "ALL_REDUCE", 3),
    ("1f1b", True, "ALL_REDUCE", 1),
]
DP2_PP2 = [("1f1b", True, "ALL_REDUCE", 5), ("afab", False, "ALL_REDUCE", 2)]


def test_llama_pipeline_equals_one_process_for_pp_2_4_tp_1_2_every_engine() -> None:
    """One 4-process launch: pp=4, pp=2 x tp=2, pp=2 x dp=2; afab and 1f1b here, zb-h1 and
    zbv from test_zero_bubble.ZB_CASES on the same layouts (one launch and one set of groups
    for every engine)."""
    from tests.pipeline.test_zero_bubble import ZB_CASES, check_zb_results

    layouts = [
        (1, 1, 4, 4, PP4, ZB_CASES["pp4"]),
        (1, 2, 2, 3, PP2_TP2, ZB_CASES["tp2_pp2"]),
        (2, 1, 2, 3, DP2_PP2, ZB_CASES["dp2_pp2"]),
    ]
    results = run_distributed(_llama_worker, 4, layouts, timeout=400)
    by_layout = [[rank_results[k] for rank_results in results] for k in range(len(layouts))]
    for (_dp, _tp, pp, layers, cases, _zb), layout_results in zip(layouts, by_layout):
        # Every dp replica and tp rank of a stage reports the same stage; count one of each.
        mine = [rank_results[: len(cases)] for rank_results in layout_results]
        _check(_one_per_stage(mine), pp, layers)
        for rank_results in layout_results:  # the zero-bubble cases: checked on every rank
            assert all(r["worst"] <= 1e-5 for r in rank_results[len(cases) :])
    check_zb_results([rank_results[len(PP4) :] for rank_results in by_layout[0]])

    # Memory on the Llama too: with m = 8, 1F1B holds pp - rank micro-batches, AFAB all 8,
    # and the saved activation bytes follow the same ratio.
    for rank_results in by_layout[0]:
        by = {r["case"]: r for r in rank_results[: len(PP4)]}
        afab, ofob = by[("afab", False, "ALL_REDUCE", 8)], by[("1f1b", False, "ALL_REDUCE", 8)]
        pp_rank = afab["pp_rank"]
        assert (afab["live"], ofob["live"]) == (8, 4 - pp_rank)
        assert afab["bytes"] * (4 - pp_rank) == ofob["bytes"] * 8


def _one_per_stage(layout_results: list[list[dict]]) -> list[list[dict]]:
    seen, out = set(), []
    for rank_results in layout_results:
        stage = rank_results[0]["pp_rank"]
        if stage not in seen:
            seen.add(stage)
            out.append(rank_results)
    return out
