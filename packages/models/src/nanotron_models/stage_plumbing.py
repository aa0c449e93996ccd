"""What every family's stage does alike, written once (LlamaStage and HybridStage inherit it).

A stage (stage.ModelStage) holds named blocks: `embedding`, `decoder` (a ModuleDict by global
layer index), `final_norm`, `lm_head`, `loss`, each only if in `block_names`. The methods here
depend on nothing else: the tensor-parallel communication mode of every parallel layer and
norm, recompute and the fused loss as flags, the blocks a forward calls with the parameters
each reads (ZeRO-3 gathers those), and the logits gathered over tp. What differs between
families (the layers' context-parallel and compile set-up, the batch each forward prepares)
stays in the family's stage.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanotron_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLinearMode,
    VocabParallelEmbedding,
    gather_from_tp,
)

from .blocks import RMSNorm, linear_mode
from .moe import MoEBlock


class StagePlumbing:
    """Mixed into a family's stage (an nn.Module with `pc`, `config`, `block_names`, `decoder`
    and the blocks named there)."""

    def block(self, name: str) -> nn.Module:
        if name.startswith("decoder."):
            return self.decoder[name.split(".", 1)[1]]
        return getattr(self, name)

    def set_tp_mode(
        self,
        mode: str | TensorParallelLinearMode,
        async_communication: bool = False,
        tensor_collectives: bool | None = None,
        recompute_allgather: bool = False,
    ) -> None:
        """Switch every tp layer and norm of the stage to `mode`; `async_communication` (only
        REDUCE_SCATTER) overlaps the linears' collectives with their matmuls;
        `tensor_collectives` runs native reduce-scatters (None: under NCCL only);
        `recompute_allgather` (REDUCE_SCATTER) makes the column-parallel linears keep only
        their input shard and gather it again in the backward."""
        mode = linear_mode(mode)
        self.tp_mode = mode
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.set_communication(
                    mode, async_communication, tensor_collectives, recompute_allgather
                )
            elif isinstance(module, VocabParallelEmbedding):
                module.set_communication(mode, tensor_collectives)
            elif isinstance(module, (RMSNorm, MoEBlock)):
                module.sequence_parallel = mode == TensorParallelLinearMode.REDUCE_SCATTER

    def set_recompute(self, enabled: bool) -> None:
        """Run each decoder layer under non-reentrant activation checkpointing: its activations
        are dropped after the forward and recomputed in the backward (RNG state restored);
        only the layer's input stays alive. Every tp rank recomputes the same layers in the
        same order, so the collectives inside still match."""
        self.recompute = enabled

    def set_fused_loss(self, enabled: bool) -> None:
        """On (the default): a stage holding the lm_head and the loss computes them together,
        chunk by chunk over tokens, without the fp32 logits of the whole vocab
        (`Loss.from_hidden`); the lm_head block then passes its input through. Off: the
        lm_head returns the logit shard and the loss reads it. Same loss and gradients up to
        float rounding."""
        self.fused_loss = bool(enabled) and {"lm_head", "loss"} <= set(self.block_names)

    def called_blocks(self) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """The blocks `forward` calls, in order, each with the parameters it reads (ZeRO-3
        gathers those around the call). With the fused loss the lm_head block is not called:
        the loss block reads its weight."""
        out = []
        for name in self.block_names:
            if self.fused_loss and name == "lm_head":
                continue
            block = self.block(name)
            if self.fused_loss and name == "loss":
                out.append((block, list(self.lm_head.parameters())))
            else:
                out.append((block, list(block.parameters())))
        return out

    def gather_logits(self, shard: torch.Tensor) -> torch.Tensor:
        """Full logits [s, b, vocab] from the lm_head's shard (gathered over tp, vocab padding
        dropped)."""
        return gather_from_tp(shard, self.pc.tp_group, dim=-1)[..., : self.config.vocab_size]


def checkpointed(layer: nn.Module, x: torch.Tensor, batch: dict) -> torch.Tensor:
    """`layer(x, batch)` under non-reentrant activation checkpointing (RNG state restored)."""
    return checkpoint(layer, x, batch, use_reentrant=False, preserve_rng_state=True)
