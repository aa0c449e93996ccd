"""The `layer_stats` message: per-layer statistics of one detail step (Nanotron's
`metrics_logging`, nanotron_train/reporting/layer_stats.py).

`rows` names the layers (a parameter such as `decoder.3.attn.qkv.weight`, or a block such as
`decoder.3`), each once; `stats` maps a statistic's name (`weight_norm`, `grad_norm`,
`update_ratio`, `act_rms`, or one a later trainer adds) to one value per row, null where it has
none, NaN/inf allowed (a non-finite gradient is what this view is for). Bounded like every
ingest message: at most MAX_LAYER_ROWS rows and MAX_LAYER_STATS statistics.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints, model_validator

from .fields import Finite, Int64, Msg

MAX_LAYER_ROWS = 4096  # parameters and blocks of one message
MAX_LAYER_STATS = 16  # statistics of one message
# Parsed memory (a float in a list; a row name with its list slot) and the message itself
LAYER_VALUE_MEMORY = 40
LAYER_ROW_MEMORY = 300
LAYER_MESSAGE_MEMORY = 2048

RowName = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
]
StatName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_./-]+$")
]


class LayerStats(Msg):
    type: Literal["layer_stats"]
    step: Int64
    time: Finite | None = None
    rows: list[RowName] = Field(min_length=1, max_length=MAX_LAYER_ROWS)
    stats: dict[StatName, list[float | None]] = Field(min_length=1, max_length=MAX_LAYER_STATS)

    @model_validator(mode="after")
    def _consistent(self) -> LayerStats:
        if len(set(self.rows)) != len(self.rows):
            raise ValueError("rows: each row must appear once")
        for name, values in self.stats.items():
            if len(values) != len(self.rows):
                raise ValueError(f"stats.{name}: {len(values)} values for {len(self.rows)} rows")
        return self

    def memory_bytes(self) -> int:
        values = len(self.rows) * len(self.stats)
        return (
            LAYER_MESSAGE_MEMORY + values * LAYER_VALUE_MEMORY + len(self.rows) * LAYER_ROW_MEMORY
        )
