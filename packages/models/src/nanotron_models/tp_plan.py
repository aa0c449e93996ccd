"""A family's tensor-parallel plan: which layer is split over tp, and how, stated once.

Building reads it (each block asks the plan which parallel layer to make: `plan.linear`), and
so do initialisation and loading (`plan.shard_dim` of a parameter's global name: the
dimension init.py cuts each rank's shard on, and HF / checkpoint loading after it). A layer
the plan does not name is replicated over tp (norms, routers, experts).

Splits, as Megatron names them: COLUMN cuts a linear's outputs (weight rows and bias: dim 0;
the fused sections of q/k/v or gate/up cut part by part), ROW its inputs (weight columns:
dim 1; the bias is replicated, added after the all-reduce), VOCAB an embedding's rows.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from nanotron_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class Split(enum.Enum):
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"


# (weight's shard dim, bias's shard dim) of each split
_DIMS = {Split.COLUMN: (0, 0), Split.ROW: (1, None), Split.VOCAB: (0, None)}


@dataclass(frozen=True)
class TPPlan:
    """`layers`: a layer's name, as the end of its module path (`attn.qkv` for
    `decoder.3.attn.qkv`, `lm_head`), -> its split."""

    layers: Mapping[str, Split]
    parameters: Mapping[str, int] = field(default_factory=dict)  # name's end -> its cut dim

    def split_of(self, layer_path: str) -> Split | None:
        """The split of the layer at module path `layer_path` (None: replicated)."""
        for key, split in self.layers.items():
            if layer_path == key or layer_path.endswith("." + key):
                return split
        return None

    def shard_dim(self, param_name: str) -> int | None:
        """The dimension parameter `param_name` (a global name) is cut on (None: replicated)."""
        for key, dim in self.parameters.items():
            if param_name == key or param_name.endswith("." + key):
                return dim
        layer, _, kind = param_name.rpartition(".")
        split = self.split_of(layer)
        if split is None:
            return None
        weight_dim, bias_dim = _DIMS[split]
        return bias_dim if kind == "bias" else weight_dim

    def linear(self, layer: str) -> type[ColumnParallelLinear] | type[RowParallelLinear]:
        """The parallel linear class that builds `layer` (a key of `layers`)."""
        split = self.layers[layer]
        if split is Split.COLUMN:
            return ColumnParallelLinear
        if split is Split.ROW:
            return RowParallelLinear
        raise ValueError(f"{layer} is split {split.value}: not a linear")
