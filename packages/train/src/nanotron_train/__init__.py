"""nanotron-train: `torchrun -m nanotron_train --config-file CONFIG.yaml`.

The names below are imported lazily: `python -m nanotron_train.data ...` and the dashboard
client must not pay for importing torch and the model just because this package is imported.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Config": "nanotron_train.config",
    "ConfigError": "nanotron_train.config",
    "config_from_dict": "nanotron_train.config",
    "load_config": "nanotron_train.config",
    "train": "nanotron_train.trainer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nanotron_train' has no attribute {name!r}")
