"""Which parameters Muon takes, the logical matrices inside each, and who orthogonalises them.

Muon takes the 2-D weights of the decoder blocks; embeddings, the lm_head (tied or not),
norms and biases go to AdamW (`takes_muon`). A fused weight is several logical matrices:
the attention's qkv weight is q, k and v stacked by rows, the MLP's gate_up weight gate and up
(their `ParamMeta.sections`); a head-major fused weight's parts are interleaved head by head
(Qwen3-Next's in_proj_qkvz: per key head [q | k | v | z]; `ParamMeta.interleaved`), each
part gathered over the heads. Each is orthogonalised on its own, as if the model had separate
q/k/v and gate/up linears (as in Hugging Face Llama and in Megatron-core's Muon): one Newton-
Schulz over the fused matrix would mix the rows of q, k and v and orthogonalise them against
each other, and its update would change with how the model happens to fuse its projections.
This changes the math against `torch.optim.Muon` on the fused tensor; the one-process
reference is torch's Muon on the split matrices.

Under tensor parallel a rank holds a slice of rows (column-parallel: qkv, gate_up) or of
columns (row-parallel: o_proj, down) of each matrix. Newton-Schulz is not separable by rows
or columns (X X^T mixes every row with every other), so `orthogonal_update` all-gathers the
shards over tp into the full matrix, orthogonalises it and keeps this rank's slice: every tp
rank computes the same full result (redundantly: the matrices of one stage are 1/pp of the
model, and a second exchange to scatter an owner's result would cost as much as the gather).

Under ZeRO (`assign_owners`) every whole matrix gets one owner among the data-parallel ranks,
balanced by the Newton-Schulz cost (longest-processing-time first: largest cost to the least
loaded rank, as distributed-Muon implementations do), so each is orthogonalised once per
data-parallel group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nanotron_parallel.sharding import ParamMeta, gather_full, get_param_meta, shard_tensor
from nanotron_train.optimizer.newton_schulz import lr_ratio, orthogonalise

_NOT_MUON = re.compile(r"(^|\.)(embedding|lm_head)(\.|$)")


def takes_muon(name: str, param: nn.Parameter) -> bool:
    """A hidden 2-D weight: not an embedding or lm_head (tied or not), not a norm or a bias."""
    meta = get_param_meta(param)
    tied = meta is not None and meta.tied_key is not None
    return param.dim() == 2 and not tied and not _NOT_MUON.search(name)


@dataclass
class Matrix:
    """One Muon parameter of this stage: its place in the flat buffer of the stage's Muon
    parameters (this tp rank's shard, flattened), its logical matrices and its owner."""

    name: str
    param: nn.Parameter
    offset: int
    meta: ParamMeta | None
    owner: int = 0

    @property
    def numel(self) -> int:
        return self.param.numel()

    def full_shape(self) -> tuple[int, int]:
        shape = self.meta.full_shape if self.meta is not None else tuple(self.param.shape)
        return int(shape[0]), int(shape[1])

    def layout(self) -> tuple[int, list[tuple[int, tuple[int, ...]]]]:
        """(the fused dim, per section (n, parts)): part j of a section over its n repeats is
        one logical matrix (`ParamMeta.interleaved`); a plain section is (1, (size,))."""
        rows, cols = self.full_shape()
        meta = self.meta
        dim = meta.shard_dim if meta is not None and meta.sections else 0
        sections = meta.sections if meta is not None and meta.sections else ((rows, cols)[dim],)
        if meta is None or not meta.interleaved:
            return dim, [(1, (int(s),)) for s in sections]
        layout = [(int(n), tuple(int(p) for p in parts)) for n, parts in meta.interleaved]
        if [n * sum(parts) for n, parts in layout] != [int(s) for s in sections]:
            raise ValueError(f"{self.name}: interleaved {layout} does not tile {sections}")
        return dim, layout

    def blocks(self) -> list[tuple[int, int]]:
        """(rows, cols) of each logical matrix, in order along the fused dimension."""
        rows, cols = self.full_shape()
        dim, layout = self.layout()
        sizes = [n * p for n, parts in layout for p in parts]
        return [(s, cols) if dim == 0 else (rows, s) for s in sizes]

    def cost(self) -> int:
        """Newton-Schulz flops up to a constant: rows * cols * min(rows, cols) per block."""
        return sum(r * c * min(r, c) for r, c in self.blocks())


def stage_matrices(named_params: list[tuple[str, nn.Parameter]]) -> list[Matrix]:
    """The Muon parameters of this stage in model order, each at its flat offset."""
    out, offset = [], 0
    for name, p in named_params:
        if takes_muon(name, p):
            out.append(Matrix(name, p, offset, get_param_meta(p)))
            offset += p.numel()
    return out


def assign_owners(matrices: list[Matrix], ranks: int) -> None:
    """Longest processing time first: each matrix, by falling cost, to the least loaded rank
    (ties: the lower rank, then model order), the same on every rank."""
    load = [0] * ranks
    for m in sorted(matrices, key=lambda m: -m.cost()):
        m.owner = min(range(ranks), key=lambda r: (load[r], r))
        load[m.owner] += m.cost()


def orthogonal_update(
    m: Matrix, local: torch.Tensor, settings, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Muon's update of this rank's shard of `m`, learning-rate factor included: gather the
    full matrix over tp, orthogonalise each logical matrix, keep this rank's rows/columns."""
    meta = m.meta
    sharded = meta is not None and meta.is_sharded
    full = gather_full(local, tp_group, meta.shard_dim, meta.sections) if sharded else local
    dim, layout = m.layout()
    parts = []
    for block in split_logical(full, dim, layout):
        ortho = orthogonalise(
            block, settings.ns_coefficients, settings.ns_steps, settings.eps, settings.ns_dtype
        )
        ratio = lr_ratio(settings.adjust_lr_fn, block.shape[0], block.shape[1])
        parts.append(ortho.to(local.dtype) * ratio)
    out = parts[0] if len(parts) == 1 else join_logical(parts, dim, layout)
    if sharded:
        out = shard_tensor(out, meta.shard_dim, meta.tp_rank, meta.tp_size, meta.sections)
    return out


def split_logical(
    full: torch.Tensor, dim: int, layout: list[tuple[int, tuple[int, ...]]]
) -> list[torch.Tensor]:
    """The logical matrices of a fused 2-D tensor along `dim` (`Matrix.layout`), in order:
    each section's part j gathered over its n repeats (rows of a head-major projection)."""
    fused = full.movedim(dim, 0)
    out = []
    sections = fused.split([n * sum(parts) for n, parts in layout])
    for section, (n, parts) in zip(sections, layout, strict=True):
        grouped = section.reshape(n, sum(parts), section.shape[-1])
        for piece in grouped.split(parts, dim=1):
            out.append(piece.reshape(-1, piece.shape[-1]).movedim(0, dim))
    return out


def join_logical(
    blocks: list[torch.Tensor], dim: int, layout: list[tuple[int, tuple[int, ...]]]
) -> torch.Tensor:
    """Inverse of `split_logical`: the fused tensor from its logical matrices."""
    it = iter(blocks)
    sections = []
    for n, parts in layout:
        grouped = [next(it).movedim(dim, 0).reshape(n, p, -1) for p in parts]
        sections.append(torch.cat(grouped, dim=1).reshape(n * sum(parts), -1))
    return torch.cat(sections).movedim(0, dim).contiguous()
