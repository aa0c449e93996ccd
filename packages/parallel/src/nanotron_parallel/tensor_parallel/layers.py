"""Tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

Activations are sequence-first ``[seq, batch, hidden]``. In ``ALL_REDUCE`` mode they are
replicated over tp between tp regions; in ``REDUCE_SCATTER`` mode (sequence parallel) they are
split along dim 0 there, and the layers all-gather / reduce-scatter that dim.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.grid import ParallelConfigError
from nanotron_parallel.sharding import ParamMeta, set_param_meta, shard_tensor
from nanotron_parallel.tensor_parallel.async_linear import async_column_linear, async_row_linear
from nanotron_parallel.tensor_parallel.functional import (
    all_gather_to_tp,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_from_tp,
)
from nanotron_parallel.tensor_parallel.gather_recompute import gather_recompute_linear
from nanotron_parallel.tensor_parallel.weight_grad import split_embedding, split_linear


class TensorParallelLinearMode(str, enum.Enum):
    ALL_REDUCE = "ALL_REDUCE"
    REDUCE_SCATTER = "REDUCE_SCATTER"


def _mode(mode: TensorParallelLinearMode | str) -> TensorParallelLinearMode:
    try:
        return TensorParallelLinearMode(mode)
    except ValueError:
        choices = [m.value for m in TensorParallelLinearMode]
        raise ParallelConfigError(f"tp_mode={mode!r} must be one of {choices}") from None


def _check_async(async_communication: bool, mode: TensorParallelLinearMode, layer: str) -> bool:
    if async_communication and mode is not TensorParallelLinearMode.REDUCE_SCATTER:
        raise ParallelConfigError(
            f"{layer}: async_communication=True (tp_linear_async_communication) needs "
            f"tp_mode REDUCE_SCATTER, got {mode.value}"
        )
    return bool(async_communication)


def _tp_divide(size: int, tp: int, what: str, hint: str = "") -> int:
    if size % tp != 0:
        raise ParallelConfigError(f"{what}={size} is not divisible by tp={tp}{hint}")
    return size // tp


def _group_coords(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class _TPLinearBase(nn.Module):
    """Shared parameter creation, initialisation, full-weight loading and the choice of how
    the layer communicates (`set_communication`)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    mode: TensorParallelLinearMode
    async_communication: bool = False
    tensor_collectives: bool | None = None  # None: the backend's default
    recompute_allgather: bool = False
    # The weight's gradient accumulates into its data-parallel buffer in the backward's matmul
    # (weight_grad.split_linear); off for a layer whose weight may have another use (tied).
    fuse_grad_accumulation: bool = True

    def set_communication(
        self,
        mode: TensorParallelLinearMode | str,
        async_communication: bool = False,
        tensor_collectives: bool | None = None,
        recompute_allgather: bool = False,
    ) -> None:
        """Switch the tp mode, the overlapped (async) linears, whether reduce-scatters run
        natively (`tensor_collectives`, NCCL's default; tests force it on gloo), and, in
        REDUCE_SCATTER mode, whether a column-parallel linear keeps only its input shard and
        gathers it again in the backward (`recompute_allgather`, Nanotron's
        tp_recompute_allgather). The weights depend on none of these."""
        self.mode = _mode(mode)
        self.async_communication = _check_async(async_communication, self.mode, type(self).__name__)
        self.tensor_collectives = tensor_collectives
        sequence_parallel = self.mode is TensorParallelLinearMode.REDUCE_SCATTER
        self.recompute_allgather = bool(recompute_allgather) and sequence_parallel

    def _make_params(
        self,
        weight_shape: tuple[int, int],
        bias_size: int | None,
        full_weight_shape: tuple[int, int],
        shard_dim: int,
        sections: Sequence[int] | None,
        bias_sharded: bool,
        device,
        dtype,
    ) -> None:
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(weight_shape, **factory))
        set_param_meta(
            self.weight,
            ParamMeta(
                tuple(full_weight_shape),
                shard_dim,
                None if sections is None else tuple(int(s) for s in sections),
                self.tp_rank,
                self.tp_size,
            ),
        )
        if bias_size is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.empty(bias_size, **factory))
            if bias_sharded:
                set_param_meta(
                    self.bias,
                    ParamMeta(
                        (full_weight_shape[0],),
                        0,
                        None if sections is None else tuple(int(s) for s in sections),
                        self.tp_rank,
                        self.tp_size,
                    ),
                )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's distribution, bounded by the FULL fan-in; models overwrite this with a
        # topology-independent init through load_full().
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of full (unsharded) weight/bias tensors into the layer."""
        with torch.no_grad():
            self.weight.copy_(self._shard_weight(weight))
            if bias is not None:
                if self.bias is None:
                    raise ParallelConfigError(f"{type(self).__name__} has no bias to load")
                self.bias.copy_(self._shard_bias(bias))

    def _shard_weight(self, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _shard_bias(self, bias: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ColumnParallelLinear(_TPLinearBase):
    """y = x W^T + b with W split by output rows: weight ``[out / tp, in]``.

    ``sections`` (optional) names the parts of a fused output (e.g. q, k, v sizes); each part
    is split over tp separately, so this rank's rows are ``[q_r; k_r; v_r]``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: dist.ProcessGroup | None,
        mode: TensorParallelLinearMode | str,
        bias: bool = False,
        gather_output: bool = False,
        async_communication: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        sections: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.set_communication(mode, async_communication)
        self.tp_rank, self.tp_size = _group_coords(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sections = None if sections is None else [int(s) for s in sections]
        if self.sections is not None:
            if sum(self.sections) != out_features:
                raise ParallelConfigError(
                    f"ColumnParallelLinear: sections {self.sections} must add up to "
                    f"out_features={out_features}"
                )
            for s in self.sections:
                _tp_divide(s, self.tp_size, "ColumnParallelLinear section size")
        local_out = _tp_divide(out_features, self.tp_size, "ColumnParallelLinear out_features")
        self._make_params(
            (local_out, in_features),
            local_out if bias else None,
            (out_features, in_features),
            0,
            self.sections,
            True,
            device,
            dtype,
        )

    def _shard_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return shard_tensor(weight, 0, self.tp_rank, self.tp_size, self.sections)

    def _shard_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return shard_tensor(bias, 0, self.tp_rank, self.tp_size, self.sections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native, recompute = self.tensor_collectives, self.recompute_allgather
        fuse = self.fuse_grad_accumulation
        if self.tp_size == 1:  # no collective in any mode: no group lookup per call either
            y = split_linear(x, self.weight, self.bias, fuse)
        elif self.async_communication:  # overlapped gather
            y = async_column_linear(x, self.weight, self.bias, self.group, native, recompute)
        elif self.mode is TensorParallelLinearMode.ALL_REDUCE:
            y = split_linear(copy_to_tp(x, self.group), self.weight, self.bias, fuse)
        elif recompute:  # keep the shard, gather again in the backward
            y = gather_recompute_linear(x, self.weight, self.bias, self.group, native)
        else:
            y = split_linear(
                all_gather_to_tp(x, self.group, 0, native), self.weight, self.bias, fuse
            )
        if self.gather_output:
            y = gather_from_tp(y, self.group, dim=-1)
        return y

    def replicated_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input this rank's rows multiply, for a caller that does the matmul itself (the
        fused lm_head + loss): `x` entering the tp region (ALL_REDUCE) or its sequence
        gathered over tp (REDUCE_SCATTER); the backward sums the gradient over tp."""
        if self.mode is TensorParallelLinearMode.ALL_REDUCE:
            return copy_to_tp(x, self.group)
        return all_gather_to_tp(x, self.group, 0, self.tensor_collectives)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
            f"mode={self.mode.value}, gather_output={self.gather_output}"
        )


class RowParallelLinear(_TPLinearBase):
    """y = x W^T + b with W split by input columns: weight ``[out, in / tp]``.

    The input is already split on its last dim; partial products are all-reduced
    (ALL_REDUCE) or reduce-scattered along the sequence dim 0 (REDUCE_SCATTER).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: dist.ProcessGroup | None,
        mode: TensorParallelLinearMode | str,
        bias: bool = False,
        async_communication: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.set_communication(mode, async_communication)
        self.tp_rank, self.tp_size = _group_coords(group)
        self.in_features, self.out_features = in_features, out_features
        local_in = _tp_divide(in_features, self.tp_size, "RowParallelLinear in_features")
        self._make_params(
            (out_features, local_in),
            out_features if bias else None,
            (out_features, in_features),
            1,
            None,
            False,
            device,
            dtype,
        )

    def _shard_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return shard_tensor(weight, 1, self.tp_rank, self.tp_size)

    def _shard_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native, fuse = self.tensor_collectives, self.fuse_grad_accumulation
        if self.tp_size == 1:  # no collective in any mode: no group lookup per call either
            y = split_linear(x, self.weight, None, fuse)
        elif self.async_communication:  # backward overlaps its gather
            y = async_row_linear(x, self.weight, self.group, native)
        elif self.mode is TensorParallelLinearMode.ALL_REDUCE:
            y = reduce_from_tp(split_linear(x, self.weight, None, fuse), self.group)
        else:
            y = reduce_scatter_from_tp(
                split_linear(x, self.weight, None, fuse), self.group, 0, native
            )
        if self.bias is not None:
            # The bias is replicated; in REDUCE_SCATTER mode each rank only sees its sequence
            # chunk, so copy_to_tp sums the bias gradient over tp to make it the full one.
            bias = self.bias
            if self.mode is TensorParallelLinearMode.REDUCE_SCATTER:
                bias = copy_to_tp(bias, self.group)
            y = y + bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
            f"mode={self.mode.value}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocab) are split over tp: weight ``[num_embeddings / tp, dim]``.

    Takes ids ``[seq, batch]``; each rank looks up the ids in its vocab range (zeros
    elsewhere) and the partial results are all-reduced, or reduce-scattered along the
    sequence in REDUCE_SCATTER mode (output ``[seq / tp, batch, dim]``).
    """

    # The weight's gradient goes straight into its data-parallel buffer (split_embedding);
    # off where the weight has another use in the graph (tied to an lm_head).
    fuse_grad_accumulation: bool = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: dist.ProcessGroup | None,
        mode: TensorParallelLinearMode | str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.set_communication(mode)
        self.tp_rank, self.tp_size = _group_coords(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = _tp_divide(
            num_embeddings,
            self.tp_size,
            "VocabParallelEmbedding num_embeddings",
            " (pad the vocab to a multiple of tp)",
        )
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        set_param_meta(
            self.weight,
            ParamMeta((num_embeddings, embedding_dim), 0, None, self.tp_rank, self.tp_size),
        )
        self.reset_parameters()

    def set_communication(
        self, mode: TensorParallelLinearMode | str, tensor_collectives: bool | None = None
    ) -> None:
        """Switch the tp mode and native reduce-scatter (see `_TPLinearBase.set_communication`)."""
        self.mode = _mode(mode)
        self.tensor_collectives = tensor_collectives

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_()

    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full ``[num_embeddings, dim]`` table into the layer."""
        with torch.no_grad():
            self.weight.copy_(shard_tensor(weight, 0, self.tp_rank, self.tp_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Ids are not range-checked here (that would be a host sync per micro-batch): the
        # trainer's data checks every sample where it is read. An id outside every rank's
        # range would embed as zeros.
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = split_embedding(local_ids, self.weight, self.fuse_grad_accumulation)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.mode is TensorParallelLinearMode.ALL_REDUCE:
            return reduce_from_tp(out, self.group)
        return reduce_scatter_from_tp(out, self.group, 0, self.tensor_collectives)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, dim={self.embedding_dim}, "
            f"tp={self.tp_size}, mode={self.mode.value}"
        )
