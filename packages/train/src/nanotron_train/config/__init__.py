"""The training config: Nanotron's YAML sections as dataclasses, their loading and their checks.

schema.py holds the sections, load.py reads and writes files, checks.py runs the tables of
rows (rules.py) that each section's module contributes. The names below are the public ones.
"""

from nanotron_train.config.errors import ConfigError
from nanotron_train.config.load import config_from_dict, expand_run_name, load_config, save_config
from nanotron_train.config.schema import Config

__all__ = [
    "Config",
    "ConfigError",
    "config_from_dict",
    "expand_run_name",
    "load_config",
    "save_config",
]
