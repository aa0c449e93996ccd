"""AFAB and 1F1B on small generic stages, against one process running the whole model.

The toy model is a chain of blocks with the same contract as the Llama's: `forward(x, batch)`,
the first block reads the batch, the last returns a scalar loss. Its first and last blocks can
be tied (one weight used twice), like the Llama's embedding and lm_head.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn

from nanotron_parallel.pipeline import PipelineScheduleError, run_pipeline_step

WIDTH = 6


class ToyBlock(nn.Module):
    """kind: "first" (reads batch["x"]), "mid" (hidden -> hidden) or "last" (returns the loss)."""

    def __init__(self, kind: str, seed: int, fail_at: int | None = None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.kind = kind
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH**0.5)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        self.calls += 1
        if self.fail_at is not None and self.calls > self.fail_at:
            raise RuntimeError("injected failure in a pipeline stage")
        if self.kind == "first":
            return torch.tanh(batch["x"] @ self.weight.t())
        if self.kind == "mid":
            return torch.tanh(x @ self.weight.t())
        return ((x @ self.weight - batch["y"]) ** 2).mean()


class ToyStage(nn.Module):
    """Blocks `indices` of an n-block toy model, with global parameter names."""

    def __init__(self, n: int, indices: range, tied: bool = False, fail_at=None) -> None:
        super().__init__()
        kinds = ["first"] + ["mid"] * (n - 2) + ["last"]
        self.blocks = nn.ModuleDict(
            {str(i): ToyBlock(kinds[i], seed=100 + i, fail_at=fail_at) for i in indices}
        )
        if tied:
            _tie(self, n)

    def forward(self, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x, batch)
        return x


def _tie(stage: ToyStage, n: int) -> None:
    """Tie the last block's weight to the first's (same initial values, shared tied_key)."""
    from nanotron_parallel.sharding import ParamMeta, set_param_meta

    first = ToyBlock("first", seed=100).weight  # the seed of block 0 on every stage
    for name in ("0", str(n - 1)):
        if name in stage.blocks:
            block = stage.blocks[name]
            block.weight = nn.Parameter(first.detach().clone())
            set_param_meta(block.weight, ParamMeta((WIDTH, WIDTH), None, tied_key="toy.tied"))
    if "0" in stage.blocks and str(n - 1) in stage.blocks:  # one process: one shared object
        stage.blocks[str(n - 1)].weight = stage.blocks["0"].weight


def _micro_batches(m: int, size: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    return [
        {"x": torch.randn(size, WIDTH, generator=gen), "y": torch.randn(size, WIDTH, generator=gen)}
        for _ in range(m)
    ]


def _reference(n: int, m: int, tied: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean loss and gradients of the whole model in this process."""
    model = ToyStage(n, range(n), tied=tied)
    losses = []
    for batch in _micro_batches(m):
        loss = model(None, batch)
        (loss / m).backward()
        losses.append(loss.item())
    return sum(losses) / m, {k: g.clone() for k, g in _grads_by_name(model).items()}


def _grads_by_name(stage: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient by parameter name, a tied weight under both of its names."""
    out = {}
    for name, block in stage.blocks.items():
        out[f"blocks.{name}.weight"] = block.weight.grad
    return out


def _record_no_grad_yet(stage: nn.Module, calls: list[bool]) -> None:
    calls.append(all(p.grad is None for p in stage.parameters()))


def _schedule_worker(dp: int, pp: int, cases: list[tuple[str, int, bool]]) -> list[dict]:
    """Each case (engine, m, tied): a fresh stage, one step, checks against the reference."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.pipeline import loss_on_all_pp_ranks, partition_blocks
    from nanotron_parallel.tied import sync_tied_gradients, tied_copies_equal

    pc = ParallelContext(dp=dp, pp=pp)
    n = 2 * pp + 2
    indices = partition_blocks([1.0] * n, pp)[pc.pp_rank]
    out = []
    for engine, m, tied in cases:
        stage = ToyStage(n, indices, tied=tied)
        # Record, at each call, whether no gradient exists yet: true only when the hook runs
        # before the first (m = 1) backward, i.e. right before the last micro-batch's backward.
        calls: list[bool] = []
        hook = functools.partial(_record_no_grad_yet, stage, calls)
        result = run_pipeline_step(
            engine, stage, _micro_batches(m), pc, on_last_backward=hook, track_activations=True
        )
        if tied and m == 3:  # as under data parallel: gradients in main_grad buffers
            for p in stage.parameters():
                p.main_grad, p.grad = p.grad, None
        sync_tied_gradients(stage, pc)
        if tied and m == 3:
            for p in stage.parameters():
                p.grad = p.main_grad
        ref_loss, ref_grads = _reference(n, m, tied)
        loss = float(loss_on_all_pp_ranks(result.loss_tensor, pc))
        assert result.loss is None or abs(result.loss - loss) == 0.0
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        for name, grad in _grads_by_name(stage).items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7)
        # One SGD step keeps the tied copies bitwise equal across stages.
        with torch.no_grad():
            for p in stage.parameters():
                p -= 0.1 * p.grad
        assert tied_copies_equal(stage, pc)
        out.append(
            {
                "case": (engine, m, tied),
                "pp_rank": pc.pp_rank,
                "has_loss": result.loss is not None,
                "on_last_backward_calls": calls,
                "live": result.stats.peak_live_micro_batches,
                "bytes": result.stats.peak_saved_activation_bytes,
            }
        )
    pc.destroy()
    return out


def _check_stats(results: list[list[dict]], pp: int) -> None:
    for rank_results in results:
        by_case = {r["case"]: r for r in rank_results}
        for (engine, m, _tied), r in by_case.items():
            assert r["on_last_backward_calls"] == [m == 1]
            assert r["has_loss"] == (r["pp_rank"] == pp - 1)
            expected_live = m if engine == "afab" else min(pp - r["pp_rank"], m)
            assert r["live"] == expected_live, (engine, m, r)
            assert r["bytes"] > 0


def _layouts_worker(layouts: list[tuple[int, int, list]]) -> list[list[dict]]:
    """Each layout (dp, pp, cases) in turn on the same processes, sharing one default group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = [_schedule_worker(dp, pp, cases) for dp, pp, cases in layouts]
    dist.destroy_process_group()
    return out


def test_schedules_match_one_process_for_pp_4_2_1() -> None:
    """One 4-process launch: pp=4, then pp=2 x dp=2, then pp=1 x dp=4 (gradient accumulation,
    the tied weight shared inside the one stage)."""
    from nanotron_parallel.testing import run_distributed

    pp4 = [
        (engine, m, tied)
        for engine in ("afab", "1f1b")
        for m, tied in ((8, False), (8, True), (3, True), (1, False))
    ]
    small = [(e, m, t) for e in ("afab", "1f1b") for m, t in ((4, True), (1, False))]
    layouts = [(1, 4, pp4), (2, 2, small), (4, 1, small)]
    results = run_distributed(_layouts_worker, 4, layouts, timeout=150)
    for k, (_dp, pp, _cases) in enumerate(layouts):
        _check_stats([rank_results[k] for rank_results in results], pp=pp)

    # Memory, pp=4, m=8: 1F1B keeps pp - rank micro-batches alive, AFAB all 8; the saved
    # bytes scale the same way since every micro-batch saves tensors of the same shapes.
    for rank, rank_results in enumerate(results):
        by_case = {r["case"]: r for r in rank_results[0]}
        afab, ofob = by_case[("afab", 8, False)], by_case[("1f1b", 8, False)]
        assert (afab["live"], ofob["live"]) == (8, 4 - rank)
        assert afab["bytes"] * (4 - rank) == ofob["bytes"] * 8


def _failing_worker(engine: str) -> None:
    from nanotron_parallel.context import ParallelContext

    pc = ParallelContext(pp=2)
    fail_at = 2 if pc.pp_rank == 1 else None  # stage 1 dies on its third forward
    stage = ToyStage(6, range(0, 3) if pc.pp_rank == 0 else range(3, 6), fail_at=fail_at)
    run_pipeline_step(engine, stage, _micro_batches(8), pc)


def test_a_rank_failing_mid_schedule_fails_the_launch_fast() -> None:
    from nanotron_parallel.testing import DistributedTestError, run_distributed

    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="injected failure"):
        run_distributed(_failing_worker, 2, "1f1b", timeout=300)
    # Stage 0 is blocked in a receive that never completes: the launch fails on stage 1's
    # error (matched above) long before its timeout, not by waiting for stage 0.
    assert time.monotonic() - start < 150


def test_unknown_engine_and_empty_step_are_clear_errors() -> None:
    with pytest.raises(PipelineScheduleError, match="pp_engine"):
        run_pipeline_step("gpipe", nn.Identity(), [{}], pc=None)
    with pytest.raises(PipelineScheduleError, match="at least one micro-batch"):
        run_pipeline_step("1f1b", nn.Identity(), [], pc=None)
