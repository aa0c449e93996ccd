"""Muon for the hidden matrices, AdamW for the rest, over this rank's parameter pieces.

Muon (Keller Jordan; `torch.optim.Muon`): per matrix, momentum B = mu B + g (as torch's
`lerp`), the update U = g + mu B with Nesterov (else B), O = NewtonSchulz(U), then
W <- W (1 - lr wd) - lr * ratio(shape) * O. Everything but Newton-Schulz is elementwise, so
the momentum lives with the pieces this rank steps (its ZeRO ranges), keyed like Adam's
moments, and checkpoints store and reshard it as they do Adam's (`momentum_buffer`).

Newton-Schulz needs whole matrices (matrices.py). A step:
1. the momentum and U of this rank's pieces (elementwise);
2. under ZeRO (stage >= 1 with dp > 1) this rank's ranges of U go into a flat buffer of the
   stage's Muon parameters, zero elsewhere, summed over the data-parallel group: every rank
   then holds U of each whole (tp-local) matrix (exact: each element comes from one rank);
3. each matrix's owner gathers it over tp, orthogonalises each logical matrix and keeps its
   shard (`orthogonal_update`); under ZeRO the owners' results are summed into a second flat
   buffer over the data-parallel group the same way, so each rank reads its ranges;
4. weight decay and the update on each piece's master.
Without ZeRO every rank computes every matrix, as it steps every element. Pipeline stages
each step their own matrices. The flat buffers hold the stage's Muon parameters in fp32 for
the length of the step (two all-reduces of that size per step under ZeRO).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from nanotron_train.optim import AdamWOnPieces, Piece
from nanotron_train.optimizer.matrices import Matrix, assign_owners, orthogonal_update

MUON_STATE = ("momentum_buffer",)


@dataclass(frozen=True)
class MuonSettings:
    lr_scale: float  # Muon's learning rate / the scheduler's: the schedule's shape, scaled
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    ns_steps: int
    eps: float
    adjust_lr_fn: str | None
    ns_dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class Groups:
    """The data-parallel (ZeRO) and tensor-parallel groups a Muon step talks over."""

    dp_group: dist.ProcessGroup | None
    dp_rank: int
    dp_size: int
    zero_sharded: bool  # each rank steps only its ranges (ZeRO >= 1 with dp > 1)
    tp_group: dist.ProcessGroup | None


class MuonOnPieces:
    """Muon over the pieces of `matrices` this rank owns (all of them without ZeRO)."""

    def __init__(
        self, pieces: list[Piece], matrices: list[Matrix], settings: MuonSettings, groups: Groups
    ) -> None:
        self.pieces, self.matrices, self.s, self.g = pieces, matrices, settings, groups
        self.total = sum(m.numel for m in matrices)
        self._matrix = {id(m.param): m for m in matrices}
        assign_owners(matrices, groups.dp_size if groups.zero_sharded else 1)
        # Torch's optimizers key state by tensor; "step" lets checkpoints tell a run that
        # stepped (its adam_step) from a fresh one, as for Adam's moments.
        self.state: dict[torch.Tensor, dict] = {
            pc.master: {
                "step": torch.tensor(0.0),
                "momentum_buffer": torch.zeros_like(pc.master),
            }
            for pc in pieces
        }

    def _momentum_update(self, pc: Piece) -> torch.Tensor:
        grad = pc.grad if pc.grad.dtype == pc.master.dtype else pc.grad.to(pc.master.dtype)
        state = self.state[pc.master]
        state["step"] += 1
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - self.s.momentum)
        return grad.lerp(buf, self.s.momentum) if self.s.nesterov else buf

    def _whole(self, updates: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """U of each matrix (this tp rank's shard), by the matrix's flat offset."""
        if not self.g.zero_sharded:
            return {
                self._matrix[id(pc.param)].offset: u.view_as(pc.param)
                for pc, u in zip(self.pieces, updates)
            }
        flat = self._flat(
            (self._matrix[id(pc.param)].offset + pc.start, u) for pc, u in zip(self.pieces, updates)
        )
        return {
            m.offset: flat[m.offset : m.offset + m.numel].view_as(m.param) for m in self.matrices
        }

    def _flat(self, parts) -> torch.Tensor:
        """Sum over the data-parallel group of a zero buffer holding this rank's `parts`."""
        device = self.matrices[0].param.device
        flat = torch.zeros(self.total, dtype=torch.float32, device=device)
        for start, values in parts:
            flat[start : start + values.numel()] = values.reshape(-1)
        dist.all_reduce(flat, group=self.g.dp_group)
        return flat

    @torch.no_grad()
    def step(self, lr: float) -> None:
        if not self.matrices:
            return
        lr = lr * self.s.lr_scale
        whole = self._whole([self._momentum_update(pc) for pc in self.pieces])
        mine = [m for m in self.matrices if m.owner == self.g.dp_rank or not self.g.zero_sharded]
        ortho = {
            m.offset: orthogonal_update(m, whole[m.offset], self.s, self.g.tp_group) for m in mine
        }
        if self.g.zero_sharded:
            flat = self._flat((offset, o) for offset, o in ortho.items())
        for pc in self.pieces:
            m = self._matrix[id(pc.param)]
            if self.g.zero_sharded:
                o = flat[m.offset + pc.start : m.offset + pc.end]
            else:
                o = ortho[m.offset].reshape(-1)[pc.start : pc.end]
            pc.master.mul_(1 - lr * (self.s.weight_decay if pc.decay else 0.0))
            pc.master.add_(o, alpha=-lr)
            if pc.is_copy:
                pc.value.copy_(pc.master)


class _StateOf:
    """Checkpoints read and write `optimizer.inner.state[piece.master]` and
    `inner.param_groups`: this routes each master to the optimizer that steps it."""

    def __init__(self, adamw: AdamWOnPieces, muon: MuonOnPieces) -> None:
        self.adamw, self.muon = adamw, muon
        self.state = self
        self.param_groups = adamw.inner.param_groups if adamw.inner is not None else [{}]

    def _owner(self, master: torch.Tensor) -> dict:
        if master in self.muon.state:
            return self.muon.state
        return self.adamw.inner.state if self.adamw.inner is not None else {}

    def get(self, master: torch.Tensor, default=None):
        return self._owner(master).get(master, default)

    def __getitem__(self, master: torch.Tensor) -> dict:
        return self._owner(master)[master]

    def __setitem__(self, master: torch.Tensor, value: dict) -> None:
        self._owner(master)[master] = value

    def values(self):
        inner = self.adamw.inner
        return [*(inner.state.values() if inner is not None else []), *self.muon.state.values()]


class MuonWithAdamW:
    """The optimizer of `optimizer_factory.name: muon`: Muon's pieces, then AdamW's."""

    def __init__(self, adamw: AdamWOnPieces, muon: MuonOnPieces, settings: dict) -> None:
        self.adamw, self.muon, self._settings = adamw, muon, settings
        self.pieces = muon.pieces + adamw.pieces
        self._muon_masters = {id(pc.master) for pc in muon.pieces}
        self.inner = _StateOf(adamw, muon)

    def step(self, lr: float) -> None:
        self.muon.step(lr)
        self.adamw.step(lr)

    def state_kinds(self, piece: Piece) -> tuple[str, ...]:
        if id(piece.master) in self._muon_masters:
            return MUON_STATE
        return self.adamw.state_kinds(piece)

    def settings(self) -> dict:
        return self._settings

    def state_bytes(self) -> int:
        """AdamW's moments and masters, Muon's momentum and masters."""
        muon = sum(
            pc.master.numel() * pc.master.element_size() * (2 if pc.is_copy else 1)
            for pc in self.muon.pieces
        )
        return self.adamw.state_bytes() + muon


def muon_settings_dict(settings: MuonSettings) -> dict:
    out = asdict(settings)
    out["ns_coefficients"] = list(settings.ns_coefficients)
    out["ns_dtype"] = str(settings.ns_dtype).removeprefix("torch.")
    return out
