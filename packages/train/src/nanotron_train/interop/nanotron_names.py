"""Our parameter names <-> Nanotron's (its LlamaForTraining / Qwen2 module tree).

Used where a Nanotron user writes or has Nanotron names: the regexes of
`optimizer.weight_decay_exclude_named_params` and the files of a Nanotron checkpoint.
"""

from __future__ import annotations

import re

from nanotron_models.families import FAMILIES

# Every family's names (families.py's `nanotron_names`): a name means one parameter whatever
# the family, so the tables merge; layers are the rows' `layer_prefix`{i}.
_TOP = {k: v for row in FAMILIES.values() for k, v in row.nanotron_names.top.items()}
_DECODER = {k: v for row in FAMILIES.values() for k, v in row.nanotron_names.layer.items()}
_PREFIXES = sorted({row.layer_prefix for row in FAMILIES.values()})
_LAYER = re.compile(rf"(?:{'|'.join(re.escape(p) for p in _PREFIXES)})(\d+)\.(.+)")


def to_nanotron(name: str) -> str | None:
    """Nanotron's name of our parameter `name` (any prefix before the global name, such as an
    interleaved chunk's, is ignored); None when Nanotron has no such parameter."""
    for ours, theirs in _TOP.items():
        if name == ours or name.endswith("." + ours):
            return theirs
    match = _LAYER.search(name)
    if match and match.group(2) in _DECODER:
        return f"model.decoder.{match.group(1)}.pp_block.{_DECODER[match.group(2)]}"
    return None


def from_nanotron(name: str) -> str | None:
    """Our global name of Nanotron's parameter `name`; None when we have no such parameter."""
    for ours, theirs in _TOP.items():
        if name == theirs:
            return ours
    match = re.fullmatch(r"model\.decoder\.(\d+)\.pp_block\.(.+)", name)
    if match:
        for ours, theirs in _DECODER.items():
            if theirs == match.group(2):
                return f"{_PREFIXES[0]}{match.group(1)}.{ours}"
    return None


def excluded_from_weight_decay(name: str, patterns: list[str] | None) -> bool:
    """Nanotron's rule: a parameter gets no weight decay when a pattern re.match-es its name.
    We try our name and Nanotron's, so patterns written for either work."""
    if not patterns:
        return False
    names = [name, to_nanotron(name) or name]
    return any(re.match(p, n) for p in patterns for n in names)
