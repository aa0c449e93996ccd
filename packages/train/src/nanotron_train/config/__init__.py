"""The training config: Nanotron's YAML sections as dataclasses, their loading and their checks."""
