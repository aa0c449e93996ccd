"""Functions that run eagerly inside a compiled model, without importing the compiler.

`torch.compiler.disable` used as a decorator imports `torch._dynamo` (and sympy) when the
module is imported: over a second of CPU in every process, most of which never compile
(every worker of a launch, every command). `eager_under_compile` marks the function instead
and `prepare_compile()` — called by whatever is about to call `torch.compile` on our model —
applies `torch.compiler.disable` to every marked function at that moment, so the compiler
leaves them out of its graphs (a collective, p2p or a host-side statistic: a graph break).
Until then the marked function costs one extra Python call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

# (slot, original): the slot holds what the wrapper calls (the original, then its disabled form).
_MARKED: list[tuple[list[Callable[..., Any]], Callable[..., Any]]] = []


def eager_under_compile(fn: F) -> F:
    """`fn`, run eagerly (a graph break) inside regions compiled after `prepare_compile()`."""
    slot: list[Callable[..., Any]] = [fn]
    _MARKED.append((slot, fn))

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return slot[0](*args, **kwargs)

    return call  # type: ignore[return-value]


def prepare_compile() -> None:
    """Disable compilation of every marked function (idempotent). Call before `torch.compile`."""
    for slot, fn in _MARKED:
        if slot[0] is fn:
            slot[0] = torch.compiler.disable(fn)
