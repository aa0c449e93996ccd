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

from nanotron_parallel.context_parallel import LABEL_COUNT_KEY, context_parallel_attention
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

from .attention import attention, resolve_backend
from .config import LlamaConfig
from .init import LLAMA_TP_PLAN  # which layer is split how: built here, cut by init
from .kv_cache import KVCache
from .masks import (
    DOCUMENT_IDS_KEY,
    AttentionMask,
    index_kernel,
    masked_attention,
    shared_mask,
)
from .probes import ATTN_MAX_LOGIT, max_attention_logit, max_logit_observer
from .rms_norm_function import RMSNormFunction as _RMSNormFunction
from .rotary import RotaryTable, apply_rotary, rotate_qkv

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


class Attention(nn.Module):
    q_multiplier = 1.0  # µP's attention 1/d (parametrization.py; LlamaStage sets it)
    probe_stat, probe = ATTN_MAX_LOGIT, None  # a detail step's max logit (probes.py)

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
    ):
        super().__init__()
        c, tp = config, dist.get_world_size(group)
        self.layer, self.rotary, self.backend, self.group = layer, rotary, backend, group
        self.head_dim = c.head_dim
        self.n_heads, self.n_kv = c.num_attention_heads // tp, c.n_kv_heads // tp
        d, h = c.head_dim, c.hidden_size
        qkv_out = (c.num_attention_heads + 2 * c.n_kv_heads) * d
        sections = [c.num_attention_heads * d, c.n_kv_heads * d, c.n_kv_heads * d]
        bias = c.attention_bias
        self.qkv = LLAMA_TP_PLAN.linear("attn.qkv")(
            h, qkv_out, group, mode, bias=bias, device=device, dtype=dtype, sections=sections
        )
        self.o_proj = LLAMA_TP_PLAN.linear("attn.o_proj")(
            c.num_attention_heads * d,
            h,
            group,
            mode,
            bias=c.o_proj_bias,
            device=device,
            dtype=dtype,
        )
        self.cp_group, self.cp_size, self.cp_native, self.cp_attention = None, 1, None, "allgather"
        # The family's attention (config.py's DecoderConfig): NoPE layers, windows, documents.
        self.use_rope, self.window = c.uses_rope(layer), c.sliding_window(layer)
        self.document_masking = c.document_masking
        self.fused_rotary = getattr(c, "_fused_rotary_emb", True)

    def set_context_parallel(
        self, group, size: int, native_reduce_scatter: bool | None, attention: str | None = None
    ) -> None:
        """Hold 1/cp of every sequence (the layout of nanotron_parallel.context_parallel):
        keys and values come from the other cp ranks of `group` by `attention` (allgather,
        ring or ulysses; None keeps the current one), positions are global."""
        self.cp_group, self.cp_size, self.cp_native = group, size, native_reduce_scatter
        self.cp_attention = attention or self.cp_attention

    def mask(self, doc_ids: torch.Tensor | None, decoding: bool) -> AttentionMask | None:
        """This layer's mask beyond causality (None: plain causal). Decoding runs one document
        per sequence: only the window applies there."""
        docs = doc_ids if self.document_masking and not decoding else None
        if docs is None and self.window is None:
            return None
        return shared_mask(docs, self.window)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        key_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, (heads + 2 kv) * d / tp], the full sequence
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.n_heads + 2 * self.n_kv, self.head_dim)
        q, k, v = self._rotate(qkv, x, position_ids, kv_cache)
        if self.q_multiplier != 1.0:  # µP's q.k / d: the kernels divide by sqrt(d) again
            q = q * self.q_multiplier
        out = self.attend(q, k, v, kv_cache, key_mask, doc_ids)
        return self.o_proj(out.reshape(s, b, self.n_heads * self.head_dim))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        key_mask: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal attention of q, k, v [s, b, heads, d] -> [s, b, heads, d]: through the cache
        when decoding, the cp group's keys under context parallel, the layer's mask."""
        s, device = q.shape[0], q.device
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        backend = resolve_backend(self.backend, device)
        mask = self.mask(doc_ids, kv_cache is not None)
        if self.cp_size > 1 and kv_cache is None and key_mask is None:
            kernel = index_kernel(mask, backend, attention)
            # a detail step: the max logit of each block of scores the attention computes
            observe = max_logit_observer(self.probe, mask) if self.probe is not None else None
            out = context_parallel_attention(
                q, k, v, self.cp_group, kernel, self.cp_native,
                method=self.cp_attention, mask_fn=mask, observe=observe,
            )  # fmt: skip
        elif mask is not None:
            s_k = k.shape[0]
            k_index = torch.arange(s_k, device=device)
            q_index = k_index[s_k - s :]
            whole = kv_cache is None
            out = masked_attention(q, k, v, q_index, k_index, mask, backend, key_mask, whole)
        else:
            out = attention(q, k, v, backend, key_mask)  # [s, b, heads, d]
        if self.probe is not None and self.cp_size == 1 and kv_cache is None:  # a detail step
            self.probe.copy_(torch.maximum(self.probe, max_attention_logit(q, k, mask)))
        return out

    def _rotate(self, qkv, x, position_ids, kv_cache):
        """q, k (rotated, unless a NoPE layer) and v [s, b, heads, d]."""
        if not self.use_rope:
            return qkv.split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        cos, sin = self.cos_sin(qkv.shape[0], x, position_ids, kv_cache)
        if torch.compiler.is_compiling() or not self.fused_rotary:  # plain ops
            # One rotation for q and k together: they are adjacent in the fused projection.
            qk, v = qkv.split([self.n_heads + self.n_kv, self.n_kv], dim=2)
            q, k = apply_rotary(qk, cos, sin).split([self.n_heads, self.n_kv], dim=2)
            return q, k, v
        return rotate_qkv(qkv, cos, sin, self.n_heads, self.n_kv)

    def cos_sin(self, s: int, x, position_ids, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin broadcasting over [s, b, heads, rotary dims] for this forward's tokens."""
        offset = kv_cache.offset if kv_cache is not None else 0
        if position_ids is None:  # positions offset .. offset + s - 1: slices of the table
            cos, sin = self.rotary.cos_sin_range(offset, s, x.device, x.dtype)
        elif kv_cache is None:  # training, evaluation
            # From the positions themselves, once per micro-batch: no host read of the largest
            cos, sin = self.rotary.cos_sin_of(position_ids, x.dtype)  # [b, s, d]
            cos, sin = cos.transpose(0, 1)[:, :, None, :], sin.transpose(0, 1)[:, :, None, :]
        else:  # [b, s] -> cos/sin [s, b, 1, d]
            # Under cp every position is below the whole sequence's length: no host read.
            length = s * self.cp_size if self.cp_size > 1 else None
            cos, sin = self.rotary.cos_sin(position_ids.transpose(0, 1), x.device, x.dtype, length)
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        return cos, sin


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
