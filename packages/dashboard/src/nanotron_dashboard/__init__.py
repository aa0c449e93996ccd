"""nanotron-dashboard: a live web dashboard for nanotron training runs (no torch needed)."""

__version__ = "0.1.0"
