"""The one error a user's config can cause: it names the key and the file."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration a user wrote wrongly; the message names the key and the file."""

    def __init__(self, key: str, message: str, source: str = "<config>") -> None:
        self.key = key
        self.source = source
        self.detail = message
        super().__init__(f"{source}: {key}: {message}" if key else f"{source}: {message}")
