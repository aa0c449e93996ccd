"""The one error type of the data package: something a user gave us is wrong."""

from __future__ import annotations


class DataError(ValueError):
    """A user-caused data problem (missing input, bad Nanoset, bad weights...).

    The message names the file or the config key; the CLI prints it on one line and exits 2.
    """
