"""Errors a user can cause; the CLI turns each into one line and exit code 2."""


class DashboardError(ValueError):
    """Base class for user-facing dashboard errors."""


class DatabaseFileError(DashboardError):
    """The --db file is not a dashboard database (or is corrupt, or from a newer release)."""


class MissingAssetError(DashboardError):
    """The charting library (committed in static/vendor, shipped in the wheel) is missing."""


class StartupConfigError(DashboardError):
    """An unsafe or impossible combination of command-line options."""
