"""The models package's user-error type, apart so that any module can raise it without
importing the configs (moe/config.py is imported by config.py)."""


class ModelConfigError(ValueError):
    """A model configuration value a user can get wrong; the message names the field."""
