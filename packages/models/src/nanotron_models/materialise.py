"""Fill a stage built on the meta device with this rank's initial weights: each parameter's
full tensor from its family's init spec (init.py: the same whatever the layout), cut to this
rank's tp shard (and its local experts), with the metadata checkpoints and clipping read; and
cut full tensors into this rank's shards the same way (loading). Family-agnostic: the family
gives its `init_spec` (families.py's row)."""

from __future__ import annotations

import torch
from torch import nn

from nanotron_parallel.sharding import (
    ParamMeta,
    expert_shard,
    get_param_meta,
    mark_expert_param,
    set_param_meta,
    shard_tensor,
)

from .init import InitSpec, full_tensor
from .parametrization import as_parametrization, parametrized

TIED_KEY = "embedding.weight"  # the name tied parameters (embedding, lm_head) share


def _owner(stage: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return stage.get_submodule(path) if path else stage, attr


def _shard(spec: InitSpec, full: torch.Tensor, module: nn.Module, tp_rank: int, tp: int):
    """This rank's part of `full`: its tp shard, and of an expert tensor its local experts."""
    sections = list(spec.sections) if spec.sections else None
    data = full if spec.shard_dim is None else shard_tensor(full, spec.shard_dim, tp_rank, tp,
                                                             sections)  # fmt: skip
    if spec.experts:  # this rank's experts of the full tensor: the same at any ep size
        data = data.narrow(0, module.first_local_expert, module.num_local_experts)
    return data


def _check_plan(name: str, meta_param: torch.Tensor, spec: InitSpec) -> None:
    """The layer the block built splits `name` where its init spec cuts it: both read the
    family's one tensor-parallel plan (tp_plan.py), so a mismatch is a bug in the family."""
    layer = get_param_meta(meta_param)
    built = layer.shard_dim if layer is not None else None
    if built != spec.shard_dim:
        raise ValueError(
            f"{name}: its layer splits it on dim {built}, its init spec on {spec.shard_dim}"
        )


def materialise(
    stage, config, init_spec, tp_rank, tp, seed, std, device, dtype, scaling_method,
    parametrization="sp",
) -> None:  # fmt: skip
    """Replace every meta parameter of `stage` by this rank's initial shard (`init_spec`:
    the family's; std, scaling: init.py), and meta buffers (a sigmoid router's expert bias) by zeros; a tied lm_head on
    the embedding's stage becomes the embedding's parameter. Under a `parametrization` other
    than sp (parametrization.py), each parameter carries its learning-rate and Adam-eps
    multipliers as `lr_scale` and `eps_scale`, which the trainer's optimizer reads."""
    parametrization = as_parametrization(parametrization)
    tied_here = (
        config.tie_word_embeddings and hasattr(stage, "embedding") and hasattr(stage, "lm_head")
    )
    for name, meta_param in list(stage.named_parameters()):
        if tied_here and name == "lm_head.weight":
            continue
        rule = parametrized(init_spec(config, name, std, tp, scaling_method), name, parametrization)
        spec = rule.spec
        _check_plan(name, meta_param, spec)
        full = full_tensor(spec, seed)
        module, attr = _owner(stage, name)
        param = nn.Parameter(_shard(spec, full, module, tp_rank, tp).to(device=device, dtype=dtype))
        if spec.experts:
            mark_expert_param(param, spec.full_shape[0], module.first_local_expert)
        if parametrization.name != "sp":
            param.lr_scale, param.eps_scale = rule.lr_scale, rule.eps_scale
        tied = config.tie_word_embeddings and name in ("embedding.weight", "lm_head.weight")
        if spec.shard_dim is not None or tied:
            meta = ParamMeta(tuple(full.shape), spec.shard_dim, spec.sections, tp_rank, tp,
                             TIED_KEY if tied else None, spec.interleaved)  # fmt: skip
            set_param_meta(param, meta)
        setattr(module, attr, param)
    for name, buffer in list(stage.named_buffers()):
        if buffer.is_meta:
            module, attr = _owner(stage, name)
            setattr(module, attr, torch.zeros(buffer.shape, device=device, dtype=buffer.dtype))
    if tied_here:
        stage.lm_head.weight = stage.embedding.weight


def shard_full_tensors(
    full_sd: dict[str, torch.Tensor], config, init_spec, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """Full tensors (our names; vocab unpadded or padded) -> this tp rank's shards, split and
    vocab-padded as `init_spec` (the family's) says."""
    out = {}
    for name, tensor in full_sd.items():
        spec = init_spec(config, name, 1.0, tp_size)
        full = tensor
        if spec.pad_rows_to is not None:
            full = full[: config.vocab_size]
            if spec.pad_rows_to > full.shape[0]:
                pad = full.new_zeros(spec.pad_rows_to - full.shape[0], *full.shape[1:])
                full = torch.cat((full, pad), dim=0)
        if spec.shard_dim is None:
            out[name] = full.clone()
        else:
            sections = list(spec.sections) if spec.sections else None
            shard = shard_tensor(full, spec.shard_dim, tp_rank, tp_size, sections=sections)
            out[name] = shard.clone()
    return out


@torch.no_grad()
def load_full_tensors(stage: nn.Module, full_sd: dict[str, torch.Tensor], init_spec) -> None:
    """Copy full tensors (our global names, vocab unpadded or padded) into this rank's shards
    of `stage`'s parameters (cut as `init_spec`, the family's, says; an expert tensor's local
    experts); every parameter of the stage must be in `full_sd` (`missing_parameters`). A
    buffer `full_sd` holds (a sigmoid router's expert bias, replicated) is copied too."""
    own = dict(stage.named_parameters(remove_duplicate=False))
    pc = stage.pc
    shards = shard_full_tensors(
        {n: full_sd[n] for n in own}, stage.config, init_spec, pc.tp_rank, pc.tp_size
    )
    for name, param in own.items():
        shard, experts = shards[name], expert_shard(param)
        if experts is not None:  # full over every expert: this rank's ones
            shard = shard.narrow(0, experts.first_local_expert, experts.num_local_experts)
        param.copy_(shard.to(param.dtype))
    for name, buffer in stage.named_buffers():
        if name in full_sd:
            buffer.copy_(full_sd[name].to(buffer.dtype))


def missing_parameters(stage: nn.Module, full_sd: dict[str, torch.Tensor]) -> list[str]:
    """The stage's parameters `full_sd` lacks."""
    return [n for n, _ in stage.named_parameters(remove_duplicate=False) if n not in full_sd]
