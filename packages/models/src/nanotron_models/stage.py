"""`ModelStage`: what the code outside a model family may call on a built stage.

A stage is some contiguous blocks of a model (a pipeline stage, or the whole model at pp = 1)
with this rank's tensor-parallel shards; a family's `build_stage` (families.py) returns one.
`parallelize.py` composes it through the `set_*` / `compile_layers` / `called_blocks` methods,
the pipeline engines call it as a module (`stage(x, batch)`), and inference decodes through
`logits` (pp = 1) or `decoding_batch` + `decode_blocks` + `gather_logits` (pp > 1). Nothing
else is reached into: a family whose blocks are not attention implements these and nothing
outside its own files changes. `decode_state` is what the family's `new_decode_state` made
(a KV cache for attention; conv and SSM states for a state-space mixer), passed by position
(each family names it its own way), and committed by `decode_state.commit(n_new)` once every
stage of a step ran.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

Batch = dict[str, torch.Tensor]


@runtime_checkable
class ModelStage(Protocol):
    """The declared interface of a stage (an `nn.Module`); LlamaStage implements it."""

    config: Any  # the family's config class
    pc: Any  # the ParallelContext it was built for
    block_names: list[str]  # the global names of its blocks, in forward order

    # -- training: called as a module, `stage(x, batch)` (x None on the first stage) ---------
    def __call__(self, x: torch.Tensor | None, batch: Batch) -> torch.Tensor: ...

    def block(self, name: str) -> nn.Module:
        """The block called `name` (one of `block_names`)."""
        ...

    def parameters(self, recurse: bool = True) -> Any: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any: ...

    # -- composition (parallelize.py; names of parameters never change) ----------------------
    def set_tp_mode(
        self,
        mode: Any,
        async_communication: bool = False,
        tensor_collectives: bool | None = None,
        recompute_allgather: bool = False,
    ) -> None: ...

    def set_fused_loss(self, enabled: bool) -> None: ...

    def set_context_parallel(
        self,
        group: Any,
        size: int,
        native_reduce_scatter: bool | None = None,
        attention: str | None = None,
    ) -> None: ...

    def set_recompute(self, enabled: bool) -> None: ...

    def compile_layers(self) -> None: ...

    def called_blocks(self) -> list[tuple[nn.Module, list[nn.Parameter]]]: ...

    # -- inference ------------------------------------------------------------------------
    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        decode_state: Any = None,
        key_mask: torch.Tensor | None = None,
        /,
    ) -> torch.Tensor: ...

    def decoding_batch(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> Batch: ...

    def decode_blocks(
        self, x: torch.Tensor | None, batch: Batch, decode_state: Any, /
    ) -> torch.Tensor: ...

    def gather_logits(self, shard: torch.Tensor) -> torch.Tensor: ...
