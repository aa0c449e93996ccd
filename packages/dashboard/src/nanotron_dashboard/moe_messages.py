"""The `moe_load` message: tokens routed to each expert of each MoE layer at one logged step.

Sent by the trainer's logging rank on each logged step of a mixture-of-experts model
(nanotron_train/reporting/moe_metrics.py), after the counts were summed over every rank
holding different tokens. Bounded like every ingest message: at most MAX_MOE_LAYERS layers
and MAX_MOE_EXPERTS experts per layer, every layer with the same number of experts.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .fields import Finite, Int64, Msg

MAX_MOE_LAYERS = 1024  # layers of one message (and layer indices below 1 << 16)
MAX_MOE_EXPERTS = 1024  # experts of one layer
# Parsed memory per count (a Python int in a list, measured like the rank entries) and per layer
MOE_COUNT_MEMORY = 40
MOE_LAYER_MEMORY = 600
MOE_MESSAGE_MEMORY = 2048  # the message itself
# A layer's counts sum to at most 2^53 - 1: every count and the step's token total is then an
# integer that any JSON reader (a browser's double included) holds exactly.
MAX_LAYER_TOKENS = 2**53 - 1


class MoELayerLoad(BaseModel):
    model_config = ConfigDict(extra="forbid")
    layer: Annotated[int, Field(ge=0, lt=1 << 16)]  # the global layer index
    counts: list[Int64] = Field(min_length=1, max_length=MAX_MOE_EXPERTS)


class MoELoad(Msg):
    type: Literal["moe_load"]
    step: Int64
    time: Finite | None = None
    layers: list[MoELayerLoad] = Field(min_length=1, max_length=MAX_MOE_LAYERS)

    @model_validator(mode="after")
    def _consistent(self) -> MoELoad:
        if len({x.layer for x in self.layers}) != len(self.layers):
            raise ValueError("layers: each layer must appear once")
        for x in self.layers:
            if sum(x.counts) > MAX_LAYER_TOKENS:
                raise ValueError(
                    f"layer {x.layer}: counts sum to {sum(x.counts)}, over 2^53 - 1 (the largest "
                    "integer a browser reads exactly)"
                )
        experts = {len(x.counts) for x in self.layers}
        if len(experts) > 1:
            raise ValueError(
                f"layers: every layer must count the same experts, got {sorted(experts)}"
            )
        return self

    def memory_bytes(self) -> int:
        n = sum(len(x.counts) for x in self.layers)
        return MOE_MESSAGE_MEMORY + n * MOE_COUNT_MEMORY + len(self.layers) * MOE_LAYER_MEMORY
