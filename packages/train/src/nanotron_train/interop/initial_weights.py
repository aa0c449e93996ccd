"""`model.init_method.path` (Nanotron's ExistingCheckpointInit): start a run from the weights of
an existing checkpoint, ours or Nanotron's, with a fresh optimizer, LR schedule and data
position at step 0 (a resume, by contrast, continues all of them).

Every rank reads the full tensors and keeps its own tp shard of the parameters of its
pipeline stage (of a routed expert's stacked weights, its ep rank's experts), so the
checkpoint's layout does not matter.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from nanotron_models.families import shard_full_state_dict
from nanotron_parallel.sharding import expert_shard
from nanotron_train.checkpoints.errors import CheckpointError

_GLOBAL = re.compile(r"(embedding\.weight|final_norm\.weight|lm_head\.weight|decoder\.\d+\..+)$")


def _is_nanotron(folder: Path) -> bool:
    meta = folder / "checkpoint_metadata.json"
    try:
        return "metas" in json.loads(meta.read_text())
    except (OSError, ValueError):
        return False


def read_full_weights(path: str, model_config) -> dict[str, torch.Tensor]:
    """Our global names -> full tensors, from our checkpoint or a Nanotron one."""
    from nanotron_train.interop import nanotron_checkpoint as nt

    folder = Path(path)
    if (folder / "latest.txt").is_file() and not (folder / "checkpoint_metadata.json").exists():
        folder = folder / (folder / "latest.txt").read_text().strip()
    if _is_nanotron(folder):
        return nt.read_model_weights(folder, model_config)
    from nanotron_train.inference.model_io import full_model_tensors, open_checkpoint

    full = full_model_tensors(open_checkpoint(folder))
    if model_config.tie_word_embeddings or "lm_head.weight" not in full:
        full["lm_head.weight"] = full["embedding.weight"]
    return full


@torch.no_grad()
def load_initial_weights(model: nn.Module, path: str, model_config, tp_rank: int, tp_size: int):
    """Copy this rank's shards of the checkpoint's weights into `model`; returns how many."""
    full = read_full_weights(path, model_config)
    count = 0
    for name, param in model.named_parameters():
        match = _GLOBAL.search(name)
        key = match.group(1) if match else name
        if key not in full:
            raise CheckpointError(f"model.init_method.path {path}: it has no weights for {key}")
        shard = shard_full_state_dict({key: full[key]}, model_config, tp_rank, tp_size)[key]
        experts = expert_shard(param)
        if experts is not None and shard.shape[0] == experts.num_experts:  # this rank's experts
            shard = shard.narrow(0, experts.first_local_expert, experts.num_local_experts)
        if shard.shape != param.shape:
            raise CheckpointError(
                f"model.init_method.path {path}: {key} has shape {tuple(full[key].shape)}, "
                "which does not fit model.model_config"
            )
        param.copy_(shard.to(param.dtype))
        count += 1
    return count
