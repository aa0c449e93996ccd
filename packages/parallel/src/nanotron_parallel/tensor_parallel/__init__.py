"""Tensor parallelism: differentiable collectives, parallel layers, vocab-parallel loss."""

from nanotron_parallel.tensor_parallel.cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_with_z_loss,
)
from nanotron_parallel.tensor_parallel.functional import (
    all_gather_to_tp,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_from_tp,
    scatter_to_tp,
)
from nanotron_parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLinearMode,
    VocabParallelEmbedding,
)
from nanotron_parallel.tensor_parallel.linear_cross_entropy import (
    vocab_parallel_linear_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelLinearMode",
    "VocabParallelEmbedding",
    "all_gather_to_tp",
    "copy_to_tp",
    "gather_from_tp",
    "reduce_from_tp",
    "reduce_scatter_from_tp",
    "scatter_to_tp",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_with_z_loss",
    "vocab_parallel_linear_cross_entropy",
]
