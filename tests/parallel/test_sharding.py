"""Full tensor <-> shards, fused sections, and parameter metadata (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from nanotron_parallel import (
    ParallelConfigError,
    ParamMeta,
    get_param_meta,
    set_param_meta,
    shard_tensor,
    unshard_tensor,
)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shard_then_unshard_is_identity(world: int, dim: int) -> None:
    full = torch.arange(8 * 4 * 8, dtype=torch.float32).view(8, 4, 8)
    shards = [shard_tensor(full, dim, r, world) for r in range(world)]
    size = full.shape[dim] // world
    for r, s in enumerate(shards):
        assert torch.equal(s, full.narrow(dim % 3, r * size, size))
        assert s.is_contiguous() and s.data_ptr() != full.data_ptr()
    assert torch.equal(unshard_tensor(shards, dim), full)


def test_sections_split_each_part_separately() -> None:
    # A fused [q; k; v] weight with q=4 rows, k=v=2 rows, over 2 ranks.
    q, k, v = torch.full((4, 3), 1.0), torch.full((2, 3), 2.0), torch.full((2, 3), 3.0)
    q[:, 0] = torch.arange(4)
    full = torch.cat([q, k, v])
    s0 = shard_tensor(full, 0, 0, 2, sections=[4, 2, 2])
    s1 = shard_tensor(full, 0, 1, 2, sections=[4, 2, 2])
    assert s0[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]  # q rows 0-1, then k row 0, v row 0
    assert s1[:, 0].tolist() == [2.0, 3.0, 2.0, 3.0]  # q rows 2-3, then k row 1, v row 1
    assert torch.equal(unshard_tensor([s0, s1], 0, sections=[4, 2, 2]), full)


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda t: shard_tensor(t, 0, 0, 3), "not divisible by the 3 ranks"),
        (lambda t: shard_tensor(t, 0, 2, 2), "rank=2 is outside"),
        (lambda t: shard_tensor(t, 0, 0, 2, sections=[4, 3]), "add up to the dim size 8"),
        (lambda t: shard_tensor(t, 0, 0, 2, sections=[5, 3]), "size 5"),
        (lambda t: unshard_tensor([t, t[:2]], 0), "different shapes"),
        (lambda t: unshard_tensor([], 0), "at least one shard"),
    ],
)
def test_bad_sharding_requests(call, needle: str) -> None:
    with pytest.raises(ParallelConfigError, match=needle):
        call(torch.zeros(8, 2))


def test_param_meta_lives_on_the_parameter() -> None:
    p = torch.nn.Parameter(torch.zeros(2, 3))
    assert get_param_meta(p) is None
    meta = ParamMeta((4, 3), 0, (2, 2), tp_rank=1, tp_size=2, tied_key="embed")
    set_param_meta(p, meta)
    assert get_param_meta(p) is meta and meta.is_sharded
    assert not ParamMeta((3,), None).is_sharded
    module = torch.nn.Module()
    module.w = p
    assert get_param_meta(dict(module.named_parameters())["w"]) == meta
