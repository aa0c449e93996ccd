"""A collective and its conjugate as one autograd function.

Many of the exchanges of the parallel dimensions come in pairs whose gradients are each
other: all-gather rows / reduce-scatter rows (expert parallel's all-gather dispatcher),
sequence-to-heads / heads-to-sequence (Ulysses). `conjugate(forward, backward)` makes the
autograd function of `forward(x, group)` whose input gradient is `backward(grad, group)`,
instead of one hand-written class per direction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Exchange = Callable[[torch.Tensor, Any], torch.Tensor]


def conjugate(forward: Exchange, backward: Exchange) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """`apply(x, group)`: forward(x, group), differentiated by backward(grad, group)."""

    class _Conjugate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
            return backward(grad, ctx.group), None

    _Conjugate.__name__ = _Conjugate.__qualname__ = f"Conjugate[{forward.__name__}]"
    return _Conjugate.apply
