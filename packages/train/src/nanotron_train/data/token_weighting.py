"""The token-weighted loss of a global batch (supervised fine-tuning): the sum of the losses of
every labelled token of the step, over all micro-batches and dp ranks, divided by their count.

The step already averages: the pipeline divides each micro-batch's loss by M (micro-batches)
and the gradient reduction and logged loss take the mean over dp x cp. So each micro-batch's
loss divides its summed token losses by `Loss.DIVISOR_KEY` = N / (M * dp) (N: labelled tokens
of the global batch; under cp, the Loss also multiplies by cp as it does for its own count):
M * dp * sum / N, averaged M and dp times, is sum over the global batch / N. A mean of
per-micro-batch means would instead weigh a token of a short answer more than one of a long.

N is this rank's labels (the data counts them on the host) summed over dp by one all-reduce of
a device tensor: no host sync, so a step stays asynchronous. Each cp rank holds the same whole
micro-batches here (they are split afterwards), so the sum is over dp only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron_models.blocks import Loss
from nanotron_train.data.sft import LABELLED_TOKENS_KEY


def weigh_by_labelled_tokens(micro_batches: list[dict], pc) -> torch.Tensor | None:
    """Give each micro-batch the divisor of a token-weighted global loss; returns N, the
    labelled tokens of the global batch (a 0-d int64 device tensor). None, and the batches
    untouched, when they do not count their labels (pretraining data)."""
    if not micro_batches or LABELLED_TOKENS_KEY not in micro_batches[0]:
        return None
    # host tensors summed as tensors: not even a host scalar read
    local = torch.stack([mb.pop(LABELLED_TOKENS_KEY) for mb in micro_batches]).sum()
    total = local.to(pc.device, non_blocking=True)
    if pc.dp_size > 1:
        dist.all_reduce(total, group=pc.dp_group)
    divisor = total.clamp(min=1).to(torch.float32) / (len(micro_batches) * pc.dp_size)
    for mb in micro_batches:
        mb[Loss.DIVISOR_KEY] = divisor
    return total
