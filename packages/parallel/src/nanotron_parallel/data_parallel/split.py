"""Dense and expert parameters reduced over their own groups, seen as one data-parallel object.

Under expert parallelism a stage's parameters come in two kinds (nanotron_parallel.grid):
dense ones are replicated over dp x cp and reduce (and ZeRO-shard) over `dp_cp`; a routed
expert's weights are held by the ranks with the same ep_rank, so they reduce and shard over
`edp_cp`. Their gradients are SUMMED there and scaled like the dense ones, by 1 / (dp * cp):
through the all-to-all's backward each expert already received the contributions of every
token of its ep group, so the sum over edp x cp covers every token of the batch once, as the
dense mean does.

`SplitGrads` holds one data-parallel object per kind (separate buckets, each reduced over its
group, the same ZeRO stage) and answers the trainer, the optimizer, clipping and checkpoints
as one: each question goes to both parts, or to the part owning the parameter. Each part
counts its own owned ranges in the norm once over its group, so an expert element is counted
once per ep rank's slice and a dense one once in all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.data_parallel.buckets import DataParallelGrads, OwnedPiece


class SplitGrads:
    """`dense` (over dp x cp) and `experts` (over edp x cp) as one data-parallel object."""

    def __init__(self, dense: DataParallelGrads, experts: DataParallelGrads) -> None:
        self.dense, self.experts = dense, experts
        self.parts = (dense, experts)
        self._expert_ids = {id(p) for p in experts.params}
        self.params = dense.params + experts.params
        self.buckets = dense.buckets + experts.buckets

    # The dense group is "the" data-parallel group (Muon's dp sharding, sanity checks).
    @property
    def zero_stage(self) -> int:
        return max(self.dense.zero_stage, self.experts.zero_stage)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.dense.dp_group

    @property
    def dp_size(self) -> int:
        return self.dense.dp_size

    @property
    def dp_rank(self) -> int:
        return self.dense.dp_rank

    def part(self, param: nn.Parameter) -> DataParallelGrads:
        return self.experts if id(param) in self._expert_ids else self.dense

    def arm(self) -> None:
        for part in self.parts:
            part.arm()

    def finish(self) -> None:
        for part in self.parts:
            part.finish()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def gather_params(self) -> None:
        for part in self.parts:
            part.gather_params()

    def remove_hooks(self) -> None:
        for part in self.parts:
            part.remove_hooks()

    def owned_pieces(self) -> list[OwnedPiece]:
        return self.dense.owned_pieces() + self.experts.owned_pieces()

    def norm_pieces(self, counts: Callable[[nn.Parameter], bool]) -> list[OwnedPiece]:
        return self.dense.norm_pieces(counts) + self.experts.norm_pieces(counts)

    def owned_grads(self) -> list[torch.Tensor]:
        return self.dense.owned_grads() + self.experts.owned_grads()

    def grad_norm_views(self, counts: Callable[[nn.Parameter], bool]) -> list[torch.Tensor]:
        return self.dense.grad_norm_views(counts) + self.experts.grad_norm_views(counts)

    def tied_grad(self, param: nn.Parameter) -> torch.Tensor:
        return self.part(param).tied_grad(param)

    def local_grads(self, param: nn.Parameter) -> list[torch.Tensor]:
        return self.part(param).local_grads(param)

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        with self.dense.full_parameters(), self.experts.full_parameters():
            yield

    def memory_bytes(self) -> dict[str, int]:
        dense, experts = self.dense.memory_bytes(), self.experts.memory_bytes()
        return {k: dense[k] + experts[k] for k in dense}
