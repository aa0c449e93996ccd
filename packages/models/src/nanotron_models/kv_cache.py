"""A key/value cache for incremental decoding (one per model replica; holds this rank's heads)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    """Past keys and values per decoder layer, [s_past, b, kv_heads_local, d] each (sequence-first).

    `offset` is the number of committed tokens; a forward appends its new keys/values to each
    layer, then `commit(n)` accepts the first n new tokens (dropping any padding appended to
    make the sequence divisible by tp in sequence-parallel mode).
    """

    offset: int = 0
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this forward's k, v for `layer`; return all keys and values so far."""
        if layer in self.keys:
            k = torch.cat((self.keys[layer][: self.offset], k), dim=0)
            v = torch.cat((self.values[layer][: self.offset], v), dim=0)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def commit(self, n_new: int) -> None:
        self.offset += n_new
        for layer in self.keys:
            self.keys[layer] = self.keys[layer][: self.offset]
            self.values[layer] = self.values[layer][: self.offset]

    def reset(self) -> None:
        self.offset = 0
        self.keys.clear()
        self.values.clear()
