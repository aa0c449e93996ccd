"""AdamW (or SGD) over this rank's parameter ranges, with fp32 master weights where needed.

The optimizer sees one fp32 "master" tensor per owned range (the whole parameter for
zero_stage 0, this dp rank's part under ZeRO). When the parameter is fp32 the master is a view
into it (ZeRO-3: into this rank's parameter shard), so stepping it updates the model in place;
when the model is bf16/fp16 the master is an
fp32 copy, stepped and then copied back (accumulate_grad_in_fp32). Weight decay applies to every
parameter except those whose name (ours or Nanotron's) a regex of
`optimizer.weight_decay_exclude_named_params` matches, as in Nanotron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from nanotron_parallel.data_parallel import OwnedPiece
from nanotron_train.blocked_adamw import blocked_adamw_step, supports_blocked
from nanotron_train.interop.nanotron_names import excluded_from_weight_decay

ADAM_STATE = ("exp_avg", "exp_avg_sq")  # the per-element state checkpoints store


class OptimizerConfigError(ValueError):
    """An optimizer setting that cannot work here."""


@dataclass
class Piece:
    name: str
    param: nn.Parameter
    start: int
    end: int
    master: torch.Tensor  # fp32, 1-D, end - start elements
    is_copy: bool  # master is a separate fp32 tensor (low-precision model)
    decay: bool
    value: torch.Tensor  # where the parameter's elements live (ZeRO-3: this rank's shard)
    grad: torch.Tensor  # their reduced gradient (ZeRO-2/3: in this rank's gradient shard)
    lr_scale: float = 1.0  # its learning rate is the schedule's times this (µP: per layer)
    eps_scale: float = 1.0  # its Adam eps is the configured one times this (CompleteP)


def build_pieces(
    owned: list[OwnedPiece],
    names: dict[int, str],
    master_dtype=torch.float32,
    exclude_from_decay: list[str] | None = None,
) -> list[Piece]:
    """One Piece per range the data-parallel object gives this rank (`owned_pieces()`)."""
    pieces = []
    for o in owned:
        if o.value.dtype == master_dtype:
            master, is_copy = o.value, False
        else:
            master, is_copy = o.value.to(master_dtype).clone(), True
        name = names.get(id(o.param), "")
        decay = not excluded_from_weight_decay(name, exclude_from_decay)
        # set on the parameter when it was built, by its parametrization (nanotron_models)
        scale = float(getattr(o.param, "lr_scale", 1.0))
        eps = float(getattr(o.param, "eps_scale", 1.0))
        pieces.append(Piece(name, o.param, o.start, o.end, master, is_copy, decay, o.value,
                            o.grad, scale, eps))  # fmt: skip
    return pieces


def optimizer_kwargs(factory) -> dict:
    """AdamWOnPieces keywords from `optimizer.optimizer_factory` (Nanotron's defaults filled in)."""
    if factory.name == "sgd":
        return {"name": "sgd", "betas": (0.0, 0.0), "eps": 0.0}
    return {
        "name": "adamW",
        "betas": (
            0.9 if factory.adam_beta1 is None else factory.adam_beta1,
            0.95 if factory.adam_beta2 is None else factory.adam_beta2,
        ),
        "eps": 1e-8 if factory.adam_eps is None else factory.adam_eps,
        "fused": bool(factory.torch_adam_is_fused),
    }


def _param_groups(pieces: list[Piece], weight_decay: float, eps: float) -> list[dict]:
    """One group per (weight decay, learning-rate and eps multipliers), in first-seen order:
    the sp groups (decayed, then not) are those of before µP, so the optimizer steps the same."""
    groups: dict[tuple[bool, float, float], dict] = {}
    for decay in (True, False):
        for pc in pieces:
            if pc.decay == decay:
                key = (decay, pc.lr_scale, pc.eps_scale)
                wd = weight_decay if decay else 0.0
                group = groups.setdefault(key, {"params": [], "weight_decay": wd,
                                                "lr_scale": pc.lr_scale})  # fmt: skip
                if pc.eps_scale != 1.0:
                    group["eps"] = eps * pc.eps_scale
                group["params"].append(pc.master)
    return list(groups.values()) or [{"params": [], "weight_decay": 0.0, "lr_scale": 1.0}]


class AdamWOnPieces:
    """torch.optim.AdamW (or, `name="sgd"`, torch.optim.SGD as Nanotron builds it: no momentum)
    stepping the masters with the reduced gradients of their ranges (`Piece.grad`)."""

    def __init__(
        self,
        pieces: list[Piece],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        fused: bool = False,
        name: str = "adamW",
    ) -> None:
        self.pieces = pieces
        self._settings = {"name": name, "lr": lr, "weight_decay": weight_decay}
        if name != "sgd":
            self._settings.update(betas=list(betas), eps=eps, fused=fused)
        groups = _param_groups(pieces, weight_decay, eps)
        scales = {pc.name: pc.lr_scale for pc in pieces if pc.lr_scale != 1.0}
        if scales:  # recorded in checkpoints (µP's per-parameter learning rates)
            self._settings["lr_scales"] = scales
        eps_scales = {pc.name: pc.eps_scale for pc in pieces if pc.eps_scale != 1.0}
        if eps_scales:
            self._settings["eps_scales"] = eps_scales
        # fused (torch_adam_is_fused) rounds differently (~1e-7). Otherwise: on GPUs foreach
        # (a few kernels over all tensors, bitwise the per-tensor loop's result); on the CPU
        # the loop's arithmetic run block by block in cache (blocked_adamw.py).
        on_cpu = all(pc.master.device.type == "cpu" for pc in pieces)
        kwargs = {"fused": True} if fused else {"foreach": name != "sgd" and not on_cpu}
        self._foreach, self.blocked = kwargs.get("foreach"), False
        if not any(g["params"] for g in groups):
            # A rank that owns nothing (tiny model, large dp) still runs the same steps.
            self.inner = None
        elif name == "sgd":
            self.inner = torch.optim.SGD(groups, lr=lr, **kwargs)
        else:
            self.inner = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kwargs)
            self.blocked = supports_blocked(self.inner)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for pc in self.pieces:
            grad = pc.grad
            pc.master.grad = grad if grad.dtype == pc.master.dtype else grad.to(pc.master.dtype)
        if self.inner is not None:
            for group in self.inner.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            if self.blocked:  # named as torch names its step, for profiles
                with record_function("Optimizer.step#AdamW.step"):
                    blocked_adamw_step(self.inner)
            else:
                self.inner.step()
        for pc in self.pieces:
            pc.master.grad = None
            if pc.is_copy:
                pc.value.copy_(pc.master)

    def state_kinds(self, piece: Piece) -> tuple[str, ...]:
        """The per-element state of `piece` a checkpoint stores (SGD holds none: never stepped)."""
        return ADAM_STATE

    def settings(self) -> dict:
        """This optimizer's settings, as the checkpoint records them."""
        return self._settings

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (Adam moments plus fp32 master copies)."""
        total = sum(
            pc.master.numel() * pc.master.element_size() for pc in self.pieces if pc.is_copy
        )
        if self.inner is not None:
            for state in self.inner.state.values():
                for value in state.values():
                    if torch.is_tensor(value) and value.numel() > 1:
                        total += value.numel() * value.element_size()
        return total

    def state_dict(self) -> dict:
        """Moments keyed by (name, start, end), so a checkpoint can re-slice them under any layout."""
        out: dict = {"pieces": [], "inner": None}
        if self.inner is not None:
            out["inner"] = self.inner.state_dict()
        out["pieces"] = [(pc.name, pc.start, pc.end) for pc in self.pieces]
        out["masters"] = [pc.master.clone() for pc in self.pieces if pc.is_copy]
        return out

    def load_state_dict(self, state: dict) -> None:
        if [tuple(x) for x in state["pieces"]] != [
            (pc.name, pc.start, pc.end) for pc in self.pieces
        ]:
            raise OptimizerConfigError("optimizer state does not match this layout's parameters")
        if self.inner is not None and state["inner"] is not None:
            self.inner.load_state_dict(state["inner"])
            for group in self.inner.param_groups:  # this run's devices choose, not the saver's
                group["foreach"] = self._foreach
        copies = [pc for pc in self.pieces if pc.is_copy]
        for pc, master in zip(copies, state.get("masters", [])):
            pc.master.copy_(master)
