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

`accumulate_rows` does the same for an embedding, whose weight gradient is its output
gradient's rows added into the rows of the ids looked up: autograd's way fills a zero tensor
of the whole table, adds the rows, and passes over the table again to add it to the buffer,
per micro-batch. Here the rows go straight into the buffer: one fill per step, not one per
micro-batch and parameter-sized passes none.

`accumulate_scaled` takes a gradient computed ahead of the backward (the fused lm_head and
cross-entropy make theirs in the forward) and the factor the backward brings, a 0-d tensor
on the device: the product goes into the buffer in one pass, where autograd's way scaled it
in place and then passed over it again to add it.
"""

from __future__ import annotations

import math

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


def accumulate_rows(
    main: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, scale: float, first: bool
) -> None:
    """main (+)= scale * (row i of `rows` added to row ids[i] of a zero table), `main` the
    [vocab, h] buffer, `ids` [n], `rows` [n, h]. The first write is bitwise autograd's (the
    rows summed in order from zero, as embedding_dense_backward does, then scaled); a later
    one adds each scaled row (last-bit differences). Low-precision rows are summed in the
    buffer's precision."""
    rows = rows.to(main.dtype)
    if not first:
        main.index_add_(0, ids, rows, alpha=scale)
        return
    main.zero_()
    if math.frexp(scale)[0] == 0.5:  # a power of two (1, 1/dp for dp = 2, 4, ...) scales exactly
        main.index_add_(0, ids, rows, alpha=scale)
    else:
        main.index_add_(0, ids, rows).mul_(scale)


def accumulate_scaled(
    main: torch.Tensor, grad: torch.Tensor, factor: torch.Tensor, scale: float, first: bool
) -> None:
    """main (+)= grad * factor * scale, `factor` a 0-d tensor (never read on the host). The
    first write is bitwise the product then the scaled write; a later one adds in one
    `addcmul_` (last-bit differences)."""
    if not first:
        main.addcmul_(grad, factor.to(main.dtype), value=scale)
        return
    torch.mul(grad, factor, out=main)
    if scale != 1.0:
        main.mul_(scale)
