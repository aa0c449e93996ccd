"""How a micro-batch's gradient enters a gradient buffer (`param.main_grad`).

Each gradient is added pre-scaled (by 1/dp: the reduction then sums means). The step's first
gradient of a parameter is written instead of added to zeros (bitwise the same values), so the
buffers need no clearing pass between steps.

`accumulate_product` is gradient-accumulation fusion (Megatron-LM's name): a layer whose weight
gradient is one matmul, `a @ b`, hands over the two factors instead of the product, and the
matmul writes into the buffer (first micro-batch) or adds into it (`addmm_`, the later ones).
Autograd's way costs, per micro-batch and weight, a gradient tensor, a transposing copy to the
parameter's layout (the matmul yields the transpose) and a separate pass to add it; here there
is none of the three. The first write is bitwise the autograd gradient; a later micro-batch's
`addmm_` rounds the sum once instead of twice (last-bit differences from adding the product).
"""

from __future__ import annotations

import torch


def accumulate(main: torch.Tensor, grad: torch.Tensor, scale: float, first: bool) -> None:
    """main (+)= grad * scale."""
    if not first:
        if scale == 1.0:
            main.add_(grad)
        else:
            main.add_(grad, alpha=scale)
    elif scale == 1.0:
        main.copy_(grad)
    elif grad.dtype == main.dtype:
        torch.mul(grad, scale, out=main)
    else:  # a low-precision gradient into fp32: scaled in fp32, as the add would
        main.copy_(grad).mul_(scale)


def accumulate_product(
    main: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, first: bool
) -> None:
    """main (+)= (a @ b) * scale, `main` a [m, n] view, `a` [m, k], `b` [k, n]. Called from a
    backward or a zero-bubble W, where grad mode is already off (no context to enter here)."""
    if a.dtype != main.dtype or b.dtype != main.dtype:  # bf16 factors, fp32 buffer: no mixed
        accumulate(main, a.mm(b), scale, first)  # -dtype matmul; the product, then as usual
    elif not first:
        main.addmm_(a, b, alpha=scale)
    elif scale == 1.0:
        torch.mm(a, b, out=main)
    else:  # beta=0: main's stale values are not read (nor NaNs in them propagated)
        main.addmm_(a, b, beta=0, alpha=scale)
