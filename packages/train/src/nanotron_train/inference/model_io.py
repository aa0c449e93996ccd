"""A checkpoint's model for inference and export: its config, tokenizer and weights.

Weights are read with the checkpoints package's reader (`CheckpointSource`), which rebuilds
each tensor for any target tp from whatever layout the checkpoint was saved in; only the
model shards are read (never the optimizer state). Inference runs at pp = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from nanotron_models import config_from_dict
from nanotron_models.config import DTYPES
from nanotron_models.families import family_of
from nanotron_models.stage import ModelStage
from nanotron_parallel.tensor_parallel import TensorParallelLinearMode
from nanotron_train.checkpoints import CheckpointError, read_metadata, resolve_checkpoint
from nanotron_train.checkpoints.layout import ShardInfo, canonical_name
from nanotron_train.checkpoints.load import check_files
from nanotron_train.checkpoints.source import CheckpointSource

TOKENIZER_HELP = (
    "the tokenizer (folder or tokenizer.json) instead of the one the checkpoint's config names"
)


class TokenizerMissingError(ValueError):
    """The checkpoint's config names no tokenizer, or the one it names cannot be read."""


@dataclass
class CheckpointModel:
    """What a checkpoint says about its model (read from its metadata and config.yaml)."""

    folder: Path
    metadata: dict
    model_config: Any  # as trained (vocab already padded by the trainer), of any family
    dtype: str  # model.dtype of the training config
    tokenizer_path: str | None  # tokenizer.tokenizer_name_or_path of the training config
    train_config: dict  # the raw config.yaml

    @property
    def step(self) -> int:
        return int(self.metadata["step"])

    @property
    def sequence_length(self) -> int:
        """The training's tokens.sequence_length (blocks are placed over pipeline stages by
        their cost at it, as the trainer placed them); max_position_embeddings when the
        checkpoint has no config.yaml."""
        tokens = self.train_config.get("tokens") or {}
        length = tokens.get("sequence_length") if isinstance(tokens, dict) else None
        return int(length) if length else int(self.model_config.max_position_embeddings)


def open_checkpoint(path: str | Path, tokenizer: str | None = None) -> CheckpointModel:
    """A step folder, or a checkpoints root (its latest.txt picks the step); `tokenizer`
    (the commands' --tokenizer) replaces the one its config names."""
    folder = resolve_checkpoint(str(path), None)
    meta = read_metadata(folder)
    check_files(folder, meta)
    try:
        raw = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    except FileNotFoundError:
        raw = {}
    except yaml.YAMLError:
        raise CheckpointError(f"{folder / 'config.yaml'}: not valid YAML") from None
    if not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{folder}: checkpoint_metadata.json has no model_config")
    model = raw.get("model") or {}
    tok = tokenizer or (raw.get("tokenizer") or {}).get("tokenizer_name_or_path")
    return CheckpointModel(
        folder=folder,
        metadata=meta,
        model_config=config_from_dict(meta["model_config"]),
        dtype=str(model.get("dtype", "float32")),
        tokenizer_path=str(tok) if tok else None,
        train_config=raw,
    )


def load_tokenizer_of(ckpt: CheckpointModel):
    """The checkpoint's tokenizer (nanotron_train.data.LoadedTokenizer); a clear error if none."""
    from nanotron_train.data import DataError, load_tokenizer

    if not ckpt.tokenizer_path:
        raise TokenizerMissingError(
            f"{ckpt.folder / 'config.yaml'}: tokenizer.tokenizer_name_or_path is not set, so "
            "there is no tokenizer to encode prompts (pass --tokenizer PATH: the tokenizer the "
            "model was trained with)"
        )
    try:
        return load_tokenizer(ckpt.tokenizer_path)
    except DataError as exc:
        raise TokenizerMissingError(
            f"the checkpoint's tokenizer: {exc} (pass --tokenizer PATH to use another copy)"
        ) from None


def load_model(
    ckpt: CheckpointModel, pc, dtype: torch.dtype | None = None, device=None
) -> ModelStage:
    """The whole model (pp = 1), or this rank's pipeline stage (blocks placed by cost as the
    trainer places them), with this rank's tp shards of the checkpoint's weights.

    Built in ALL_REDUCE mode whatever the training used: the weights do not depend on it.
    """
    from nanotron_train.model_factory import build_family_stage, checkpoint_parametrization

    dtype = dtype if dtype is not None else DTYPES.get(ckpt.dtype, torch.float32)
    mc = ckpt.model_config
    if pc.pp_size > mc.num_hidden_layers:  # the trainer's rule for its stages
        raise CheckpointError(
            f"--pp {pc.pp_size}: more pipeline stages than the model's "
            f"{mc.num_hidden_layers} decoder layers"
        )
    model = build_family_stage(
        mc,
        pc,
        ckpt.sequence_length,
        pc.pp_rank,
        pc.pp_size,
        tp_mode=TensorParallelLinearMode.ALL_REDUCE,
        dtype=dtype,
        device=device if device is not None else pc.device,
        # µP / CompleteP's forward multipliers are part of the model (not sp: only then)
        **({"parametrization": p} if (p := checkpoint_parametrization(ckpt.train_config, mc)).name
           != "sp" else {}),
    )  # fmt: skip
    src = CheckpointSource.open(ckpt.folder, ckpt.metadata)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the embedding's Parameter
            target = ShardInfo.of(p, pc.tp_rank, pc.tp_size)
            p.copy_(src.model_shard(canonical_name(name, p), target).to(p.dtype))
    src.release()
    model.eval()
    return model


def full_model_tensors(ckpt: CheckpointModel) -> dict[str, torch.Tensor]:
    """Every stored model tensor, full and unpadded, in the checkpoint's dtype (no process group).

    A tied lm_head is stored once, as the embedding: it is absent here.
    """
    src = CheckpointSource.open(ckpt.folder, ckpt.metadata)
    vocab = ckpt.model_config.vocab_size
    tied_key = family_of(ckpt.model_config).tied_key
    out = {}
    for name, by_tp in src.model.items():
        info = next(iter(by_tp.values()))[1]
        shape = list(info.full_shape)
        if name in (tied_key, "lm_head.weight"):
            shape[0] = vocab  # drop the padding rows for the saved tp
        target = ShardInfo(tuple(shape), tuple(shape), None, None, 0, 1)
        out[name] = src.model_shard(name, target).clone()
    src.release()
    return out
