"""The Llama blocks a pipeline cuts into stages. Hidden states are sequence-first [s, b, h];
in REDUCE_SCATTER (sequence-parallel) mode they are [s/tp, b, h] between the tp regions.

Every block is called as `block(x, batch)`. Decoders read optional `batch["position_ids"]`
([b, s]; default 0..s-1 after any cached tokens) and take an optional KV cache as a keyword
argument (used by `LlamaStage.logits`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanotron_parallel.context_parallel import LABEL_COUNT_KEY
from nanotron_parallel.tensor_parallel import (
    ColumnParallelLinear,
    TensorParallelLinearMode,
    VocabParallelEmbedding,
    copy_to_tp,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_with_z_loss,
    vocab_parallel_linear_cross_entropy,
)
from nanotron_parallel.tensor_parallel.weight_grad import splitting

# attention_layer.py: the decoder's attention (the hybrid families import it from here too)
from .attention_layer import Attention
from .config import LlamaConfig
from .init import LLAMA_TP_PLAN  # which layer is split how: built here, cut by init
from .kv_cache import KVCache
from .masks import DOCUMENT_IDS_KEY
from .rms_norm_function import RMSNormFunction as _RMSNormFunction
from .rotary import RotaryTable

Batch = dict[str, torch.Tensor]


class RMSNorm(nn.Module):
    """RMSNorm with a weight replicated over tp.

    In REDUCE_SCATTER mode each rank normalises only its sequence chunk, so the weight's
    gradient is partial there: copy_to_tp sums it over tp in the backward.
    """

    def __init__(
        self,
        size: int,
        eps: float,
        group=None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
        fused: bool = True,
    ):
        super().__init__()
        self.eps, self.group, self.sequence_parallel = eps, group, sequence_parallel
        self.fused = fused  # False: plain ops (Nanotron's _fused_rms_norm: false)
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))

    output_multiplier = 1.0  # the final norm's under µP (parametrization.py)

    def forward(self, x: torch.Tensor, batch: Batch | None = None) -> torch.Tensor:
        if self.output_multiplier != 1.0:
            return self._norm(x) * self.output_multiplier
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.group) if self.sequence_parallel else self.weight
        if not self.fused:
            xf = x.float()
            return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
                x.dtype
            )
        if splitting():  # a zero-bubble step: the weight gradient's tp sum happens in its W
            group = self.group if self.sequence_parallel else None
            return _RMSNormFunction.apply(x, self.weight, self.eps, group)
        return _RMSNormFunction.apply(x, weight, self.eps)


class Embedding(VocabParallelEmbedding):
    """Token ids [b, s] -> hidden [s, b, h] ([s/tp, b, h] in REDUCE_SCATTER mode)."""

    def forward(self, x: torch.Tensor | None, batch: Batch) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch["input_ids"].transpose(0, 1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, group, mode, device=None, dtype=None):
        super().__init__()
        h, inter = config.hidden_size, config.intermediate_size
        self.gate_up = LLAMA_TP_PLAN.linear("gate_up")(
            h, 2 * inter, group, mode, device=device, dtype=dtype, sections=[inter, inter]
        )
        self.down = LLAMA_TP_PLAN.linear("down")(inter, h, group, mode, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if torch.compiler.is_compiling():  # inductor fuses the plain ops better
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(_SwiGLUFunction.apply(gate_up))


class _SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up from the fused gate_up output [..., 2 * inter], with a hand-written
    backward that writes both halves of the input gradient into one tensor: autograd's
    decomposition makes them apart and concatenates them (one pass more; same results, about
    20% faster on the CPU). Saves what autograd saves: gate_up and silu(gate)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        silu = F.silu(gate)
        ctx.save_for_backward(gate_up, silu)
        return silu * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gate_up, silu = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_in = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_in.chunk(2, dim=-1)
        torch.mul(grad, silu, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_in


class DecoderLayer(nn.Module):
    residual_multiplier = 1.0  # CompleteP's (parametrization.py; LlamaStage sets it)

    def __init__(
        self,
        config: LlamaConfig,
        layer: int,
        group,
        mode,
        rotary: RotaryTable,
        backend: str,
        device=None,
        dtype=None,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        eps, h = config.rms_norm_eps, config.hidden_size
        sp = mode == TensorParallelLinearMode.REDUCE_SCATTER
        fused = getattr(config, "_fused_rms_norm", True)
        self.input_norm = RMSNorm(h, eps, group, sp, device, dtype, fused)
        self.attn = Attention(config, layer, group, mode, rotary, backend, device, dtype)
        self.post_attn_norm = RMSNorm(h, eps, group, sp, device, dtype, fused)
        # `mlp`: another feed-forward block (a mixture of experts: model.py builds it)
        self.mlp = mlp if mlp is not None else MLP(config, group, mode, device, dtype)

    def forward(
        self, x: torch.Tensor, batch: Batch, *, kv_cache: KVCache | None = None
    ) -> torch.Tensor:
        position_ids = batch.get("position_ids")
        doc_ids = None
        if self.attn.document_masking and kv_cache is None:
            # the data's full-sequence ids (kept whole under context parallel), or derived
            # once per micro-batch from the positions (LlamaStage.with_document_ids)
            doc_ids = batch.get(DOCUMENT_IDS_KEY)
        attn_in = self.input_norm(x)
        out = self.attn(attn_in, position_ids, kv_cache, batch.get("key_mask"), doc_ids)
        r = self.residual_multiplier  # CompleteP's branch multiplier (parametrization.py)
        x = x + (out if r == 1.0 else out * r)
        out = self.mlp(self.post_attn_norm(x))
        return x + (out if r == 1.0 else out * r)


class LMHead(ColumnParallelLinear):
    """Hidden -> this rank's logit shard [s, b, vocab_padded / tp]."""

    fuse_grad_accumulation = False  # on only where the model knows it is not tied: two uses

    def forward(self, x: torch.Tensor, batch: Batch | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


class Loss(nn.Module):
    """Logit shard -> fp32 mean cross-entropy over the tokens where label_mask is true (or their
    sum divided by the batch's `DIVISOR_KEY` when it has one).

    With a z-loss coefficient the mean includes the z-loss, and `z_loss_sum` accumulates its
    detached mean per micro-batch on the device (no host sync) for the trainer to log.
    `from_hidden` computes the same from the lm_head's input, never holding the full logits.

    Under context parallelism (`cp_size` > 1) this rank holds 1/cp of each sequence: its loss
    is cp * (its token losses) / (labelled tokens of the whole micro-batch, `label_count`), so
    the mean over the cp ranks is the micro-batch's mean (nanotron_parallel.context_parallel).
    """

    # A micro-batch's loss divisor given by the trainer (a 0-d device tensor): the token-weighted
    # loss of a whole global batch (nanotron_train/data/token_weighting.py), not this one's mean.
    DIVISOR_KEY = "loss_divisor"

    def __init__(self, vocab_size: int, group, z_loss_coefficient: float = 0.0):
        super().__init__()
        self.vocab_size, self.group = vocab_size, group
        self.z_loss_coefficient = z_loss_coefficient
        self.z_loss_sum: torch.Tensor | None = None
        self.cp_size = 1

    def _count(self, mask: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The divisor of a token-weighted mean (times 1/cp under context parallelism)."""
        if self.DIVISOR_KEY in batch:
            return batch[self.DIVISOR_KEY] / self.cp_size
        if self.cp_size == 1:
            return mask.sum().clamp(min=1.0)
        return batch[LABEL_COUNT_KEY].clamp(min=1.0) / self.cp_size

    def from_hidden(self, x: torch.Tensor, batch: Batch, head: LMHead) -> torch.Tensor:
        """The loss of `head(x)`, with the lm_head matmul fused into the cross-entropy
        (nanotron_parallel's vocab_parallel_linear_cross_entropy): its logits are made chunk by
        chunk and its gradients computed in the forward when autograd will want them."""
        hidden = head.replicated_input(x)  # [s, b, h], as the lm_head multiplies it
        labels = batch["label_ids"].transpose(0, 1).flatten()
        mask = batch["label_mask"].transpose(0, 1).flatten().to(torch.float32)
        token_weights = mask / self._count(mask, batch)
        loss, z_mean = vocab_parallel_linear_cross_entropy(
            hidden.flatten(0, 1),
            head.weight,
            labels,
            token_weights,
            self.group,
            self.vocab_size,
            self.z_loss_coefficient,
            fuse_accumulation=head.fuse_grad_accumulation,
        )
        if self.z_loss_coefficient:
            self.z_loss_sum = z_mean if self.z_loss_sum is None else self.z_loss_sum + z_mean
        return loss

    def forward(
        self, logits: torch.Tensor, batch: Batch, head: LMHead | None = None
    ) -> torch.Tensor:
        """The loss of a logit shard, or with `head`, of the hidden states `logits` through
        that lm_head fused into the loss (`from_hidden`)."""
        if head is not None:
            return self.from_hidden(logits, batch, head)
        labels = batch["label_ids"].transpose(0, 1)
        mask = batch["label_mask"].transpose(0, 1).to(torch.float32)
        if self.z_loss_coefficient:
            per_token, z_loss = vocab_parallel_cross_entropy_with_z_loss(
                logits, labels, self.group, self.vocab_size, self.z_loss_coefficient
            )
            count = self._count(mask, batch)
            z_mean = (z_loss * mask).sum() / count
            self.z_loss_sum = z_mean if self.z_loss_sum is None else self.z_loss_sum + z_mean
            return (per_token * mask).sum() / count
        if dist.get_world_size(self.group) == 1 and logits.shape[-1] == self.vocab_size:
            # Nothing to split: PyTorch's fused log-softmax kernel is the same function, faster.
            flat = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
            per_token = flat.view_as(mask)
        else:
            per_token = vocab_parallel_cross_entropy(logits, labels, self.group, self.vocab_size)
        return (per_token.float() * mask).sum() / self._count(mask, batch)


def linear_mode(mode: str | TensorParallelLinearMode) -> TensorParallelLinearMode:
    return mode if isinstance(mode, TensorParallelLinearMode) else TensorParallelLinearMode(mode)
