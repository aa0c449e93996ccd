"""What decoding carries from step to step for a hybrid: per Mamba-2 layer its conv window and
SSM state (constant memory per token), and for the attention layers a KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kv_cache import KVCache
from ..mixers import Mamba2State


@dataclass
class HybridDecodeState:
    """`kv`: the attention layers' cache; `ssm`: each Mamba-2 layer's committed state;
    `pending`: the states a step's forward produced, accepted by `commit` once every stage of
    the step ran (as the KV cache accepts its new keys)."""

    kv: KVCache = field(default_factory=KVCache)
    ssm: dict[int, Mamba2State] = field(default_factory=dict)
    pending: dict[int, Mamba2State] = field(default_factory=dict)

    @property
    def offset(self) -> int:
        return self.kv.offset

    def commit(self, n_new: int) -> None:
        self.kv.commit(n_new)
        self.ssm.update(self.pending)
        self.pending.clear()

    def reset(self) -> None:
        self.kv.reset()
        self.ssm.clear()
        self.pending.clear()

    def nbytes(self) -> int:
        """Bytes held: the Mamba-2 states (fixed) plus the attention's keys and values."""
        states = sum(s.conv.nbytes + s.ssm.nbytes for s in self.ssm.values())
        kv = sum(t.nbytes for d in (self.kv.keys, self.kv.values) for t in d.values())
        return states + kv


def new_hybrid_decode_state(config) -> HybridDecodeState:
    return HybridDecodeState()
