"""Errors a user can cause; the CLI turns each into one line and exit code 2."""


class DashboardError(ValueError):
    """Base class for user-facing dashboard errors."""


class DatabaseFileError(DashboardError):
    """The --db file is not a dashboard database (or is corrupt, or from a newer release)."""


class MissingAssetError(DashboardError):
    """The charting library was not copied into static/vendor by the build step."""


class StartupConfigError(DashboardError):
    """An unsafe or impossible combination of command-line options."""
