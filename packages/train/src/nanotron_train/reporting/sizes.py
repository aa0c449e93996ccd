"""Byte sizes for people: binary units, labelled as such (1 MiB = 2**20 bytes), everywhere the
trainer prints one (step lines' memory, checkpoint listings), so that a size read in the CLI
and one read elsewhere are the same number with the same unit."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """`512 B`, `15.1 MiB`, `3.00 GiB`, `1000 MiB`: three digits or more above a KiB."""
    value, unit = float(n), _UNITS[0]
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{value:.0f} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {unit}"
