"""The optimizer factory: `optimizer.optimizer_factory.name` -> the optimizer over this rank's
pieces (optim.py: AdamW and SGD; muon.py: Muon for the hidden matrices with AdamW for the
rest). Every optimizer steps `Piece`s (the ranges the data-parallel object gives this rank),
exposes `pieces`, `inner.state[piece.master]`, `state_kinds(piece)` and `settings()` for
checkpoints, and `step(lr)` with the scheduler's learning rate."""

from __future__ import annotations

import torch

from nanotron_train.optim import AdamWOnPieces, build_pieces, optimizer_kwargs
from nanotron_train.optimizer.matrices import stage_matrices
from nanotron_train.optimizer.muon import (
    Groups,
    MuonOnPieces,
    MuonSettings,
    MuonWithAdamW,
    muon_settings_dict,
)
from nanotron_train.optimizer.newton_schulz import (
    DEFAULT_COEFFICIENTS,
    DEFAULT_EPS,
    DEFAULT_STEPS,
)


def muon_settings(opt) -> MuonSettings:
    """Muon's settings from `optimizer` (its `muon_*` factory keys, defaults filled in)."""
    f = opt.optimizer_factory
    base_lr = opt.learning_rate_scheduler.learning_rate
    lr = base_lr if f.muon_learning_rate is None else f.muon_learning_rate

    def pick(value, default):
        return default if value is None else value

    return MuonSettings(
        lr_scale=lr / base_lr,
        weight_decay=pick(f.muon_weight_decay, opt.weight_decay),
        momentum=pick(f.muon_momentum, 0.95),
        nesterov=pick(f.muon_nesterov, True),
        ns_coefficients=tuple(pick(f.muon_ns_coefficients, DEFAULT_COEFFICIENTS)),
        ns_steps=pick(f.muon_ns_steps, DEFAULT_STEPS),
        eps=pick(f.muon_eps, DEFAULT_EPS),
        adjust_lr_fn=pick(f.muon_adjust_lr_fn, "original"),
        ns_dtype=getattr(torch, pick(f.muon_ns_dtype, "bfloat16")),
    )


def build_optimizer(opt, grads, named_params, tp_group=None):
    """The optimizer of config section `opt` (OptimizerArgs) over what `grads` (the
    data-parallel object) gives this rank; `named_params` are the stage's parameters."""
    names = {id(p): n for n, p in named_params}
    pieces = build_pieces(
        grads.owned_pieces(), names, exclude_from_decay=opt.weight_decay_exclude_named_params
    )
    lr = opt.learning_rate_scheduler.learning_rate
    kwargs = optimizer_kwargs(opt.optimizer_factory)
    if opt.optimizer_factory.name != "muon":
        return AdamWOnPieces(pieces, lr=lr, weight_decay=opt.weight_decay, **kwargs)
    matrices = stage_matrices(named_params)
    muon_ids = {id(m.param) for m in matrices}
    adamw = AdamWOnPieces(
        [pc for pc in pieces if id(pc.param) not in muon_ids],
        lr=lr,
        weight_decay=opt.weight_decay,
        **kwargs,
    )
    settings = muon_settings(opt)
    groups = Groups(
        grads.dp_group,
        grads.dp_rank,
        grads.dp_size,
        zero_sharded=grads.zero_stage >= 1 and grads.dp_size > 1,
        tp_group=tp_group,
    )
    muon = MuonOnPieces(
        [pc for pc in pieces if id(pc.param) in muon_ids], matrices, settings, groups
    )
    recorded = {
        "name": "muon",
        "muon": {**muon_settings_dict(settings), "lr": lr * settings.lr_scale},
        "adamW": adamw.settings(),
        "muon_params": [m.name for m in matrices],
    }
    return MuonWithAdamW(adamw, muon, recorded)
