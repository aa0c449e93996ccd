"""nanotron-dashboard: a live web dashboard for nanotron training runs (no torch needed)."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:  # the one version of the four packages (the repository's VERSION file)
    __version__ = _version("nanotron-dashboard")
except PackageNotFoundError:  # imported from a source tree without installing (PYTHONPATH)
    __version__ = "0+unknown"
