"""The one error a user can cause with a checkpoint (bad path, damaged or mismatched files)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the problem."""
