"""Fill a stage built on the meta device with this rank's initial weights: each parameter's
full tensor from init.py (the same whatever the layout), cut to this rank's tp shard (and its
local experts), with the metadata checkpoints and clipping read."""

from __future__ import annotations

import torch
from torch import nn

from nanotron_parallel.sharding import ParamMeta, mark_expert_param, set_param_meta, shard_tensor

from .init import InitSpec, full_tensor, llama_init_spec

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


def materialise(stage, config, tp_rank, tp, seed, std, device, dtype, scaling_method) -> None:
    """Replace every meta parameter of `stage` by this rank's initial shard (std, scaling:
    init.py), and meta buffers (a sigmoid router's expert bias) by zeros; a tied lm_head on
    the embedding's stage becomes the embedding's parameter."""
    tied_here = (
        config.tie_word_embeddings and hasattr(stage, "embedding") and hasattr(stage, "lm_head")
    )
    for name, _ in list(stage.named_parameters()):
        if tied_here and name == "lm_head.weight":
            continue
        spec = llama_init_spec(config, name, std, tp, scaling_method)
        full = full_tensor(spec, seed)
        module, attr = _owner(stage, name)
        param = nn.Parameter(_shard(spec, full, module, tp_rank, tp).to(device=device, dtype=dtype))
        if spec.experts:
            mark_expert_param(param, spec.full_shape[0], module.first_local_expert)
        tied = config.tie_word_embeddings and name in ("embedding.weight", "lm_head.weight")
        if spec.shard_dim is not None or tied:
            meta = ParamMeta(tuple(full.shape), spec.shard_dim, spec.sections, tp_rank, tp,
                             TIED_KEY if tied else None)  # fmt: skip
            set_param_meta(param, meta)
        setattr(module, attr, param)
    for name, buffer in list(stage.named_buffers()):
        if buffer.is_meta:
            module, attr = _owner(stage, name)
            setattr(module, attr, torch.zeros(buffer.shape, device=device, dtype=buffer.dtype))
    if tied_here:
        stage.lm_head.weight = stage.embedding.weight
