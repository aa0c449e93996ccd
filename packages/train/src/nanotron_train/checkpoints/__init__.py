"""Checkpoints: sharded safetensors, atomic saves, exact resume, resume under another layout."""

from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.checkpoints.listing import CheckpointEntry, list_checkpoints
from nanotron_train.checkpoints.load import load_checkpoint, resolve_checkpoint
from nanotron_train.checkpoints.metadata import read_metadata
from nanotron_train.checkpoints.save import clean_leftovers, save_checkpoint

__all__ = [
    "CheckpointEntry",
    "CheckpointError",
    "clean_leftovers",
    "list_checkpoints",
    "load_checkpoint",
    "read_metadata",
    "resolve_checkpoint",
    "save_checkpoint",
]
