"""nanotron_parallel: process groups and tensor-parallel primitives for 3D-parallel training.

``testing`` (the multi-process pytest helper) is not imported here; import it explicitly.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from nanotron_parallel.context import ParallelContext
from nanotron_parallel.grid import (
    ParallelConfigError,
    grid_coords,
    group_rank_lists,
    rank_grid,
    validate_degrees,
)
from nanotron_parallel.sharding import (
    ExpertShard,
    ParamMeta,
    expert_shard,
    gather_full,
    get_param_meta,
    is_expert_param,
    mark_expert_param,
    set_param_meta,
    shard_tensor,
    unshard_tensor,
)
from nanotron_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLinearMode,
    VocabParallelEmbedding,
    all_gather_to_tp,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_from_tp,
    scatter_to_tp,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_with_z_loss,
    vocab_parallel_linear_cross_entropy,
)

try:  # the one version of the four packages (the repository's VERSION file)
    __version__ = _version("nanotron-parallel")
except PackageNotFoundError:  # imported from a source tree without installing (PYTHONPATH)
    __version__ = "0+unknown"

__all__ = [
    "ColumnParallelLinear",
    "ExpertShard",
    "ParallelConfigError",
    "ParallelContext",
    "ParamMeta",
    "RowParallelLinear",
    "TensorParallelLinearMode",
    "VocabParallelEmbedding",
    "all_gather_to_tp",
    "copy_to_tp",
    "expert_shard",
    "gather_from_tp",
    "gather_full",
    "get_param_meta",
    "grid_coords",
    "group_rank_lists",
    "is_expert_param",
    "mark_expert_param",
    "rank_grid",
    "reduce_from_tp",
    "reduce_scatter_from_tp",
    "scatter_to_tp",
    "set_param_meta",
    "shard_tensor",
    "unshard_tensor",
    "validate_degrees",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_with_z_loss",
    "vocab_parallel_linear_cross_entropy",
]
