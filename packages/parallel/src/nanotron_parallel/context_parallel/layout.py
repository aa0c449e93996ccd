"""The load-balanced causal split of every sequence over the cp ranks, and the batch slicing.

A sequence of length S is cut into 2*cp chunks of C = S / (2*cp) tokens; cp rank r holds
chunks r and 2*cp-1-r, in that order. Under a causal mask early chunks attend to few keys and
late ones to many, so pairing chunk r with its mirror gives every rank the same attention work
(2*cp+1 chunks of keys per rank), whichever attention (all-gather, ring, Ulysses) runs.

The loss. Each cp rank sees 1/cp of the labelled tokens of a micro-batch. Its loss is
``cp * (sum of its token losses) / (labelled tokens of the whole micro-batch)``, so the mean
over the cp group, which the dp x cp gradient reduction (and the logged-loss mean) already
takes, is the sequence's token-weighted mean loss: the same as one process.

The batch is sliced once, where the trainer prepares it (`split_batch`); nothing is sliced
per layer. Keys that are not per-token ([b, S] `document_ids` among them) stay whole: a mask
over global positions needs the whole sequence's documents.
"""

from __future__ import annotations

import torch

from nanotron_parallel.grid import ParallelConfigError

# Batch keys that are [b, s] per-token tensors: sliced along the sequence.
SEQUENCE_KEYS = ("input_ids", "label_ids", "label_mask", "position_ids")
LABEL_COUNT_KEY = "label_count"  # labelled tokens of the whole micro-batch (the loss divisor)


def chunk_size(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp) != 0:
        raise ParallelConfigError(
            f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}: context parallel "
            "cuts every sequence into 2*cp equal chunks"
        )
    return seq_len // (2 * cp)


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) cp rank `cp_rank` holds, in its local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def chunk_positions(chunk: int, c: int, device=None) -> torch.Tensor:
    """Global positions [c] of the tokens of chunk `chunk` (chunks of `c` tokens)."""
    return torch.arange(chunk * c, (chunk + 1) * c, device=device)


def local_positions(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions [S / cp] of this rank's tokens (its two chunks, in order)."""
    c = chunk_size(seq_len, cp)
    return torch.cat([chunk_positions(i, c, device) for i in chunk_ids(cp_rank, cp)])


def split_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (a contiguous copy)."""
    if cp == 1:
        return x
    c = chunk_size(x.shape[dim], cp)
    first, second = chunk_ids(cp_rank, cp)
    return torch.cat((x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)), dim=dim)


def to_sequence_order(by_rank: torch.Tensor, cp: int) -> torch.Tensor:
    """[cp * 2C, ...] in rank order (rank r: chunks r, 2cp-1-r) -> [2cp * C, ...] in order."""
    parts = by_rank.view(cp, 2, by_rank.shape[0] // (2 * cp), *by_rank.shape[1:])
    # chunks 0..cp-1 are the first halves in rank order; cp..2cp-1 the second halves reversed
    return torch.cat((parts[:, 0], parts[:, 1].flip(0))).flatten(0, 1)


def to_rank_order(in_order: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of `to_sequence_order`: [2cp * C, ...] -> rank r's two chunks, r = 0.."""
    chunks = in_order.view(2 * cp, in_order.shape[0] // (2 * cp), *in_order.shape[1:])
    return torch.stack((chunks[:cp], chunks[cp:].flip(0)), dim=1).flatten(0, 2)


def split_batch(batch: dict[str, torch.Tensor], cp_rank: int, cp: int) -> dict[str, torch.Tensor]:
    """This cp rank's part of a micro-batch of [b, S] tensors: its two chunks of each
    sequence-long key, the global positions of its tokens (unless the data gave its own
    position_ids, which are sliced like the tokens), and `label_count`, the labelled tokens of
    the whole micro-batch, which the loss divides by. A micro-batch is returned as it is when
    cp = 1."""
    if cp == 1:
        return batch
    seq_len = batch["input_ids"].shape[1]
    out = {
        k: split_sequence(v, 1, cp_rank, cp) if k in SEQUENCE_KEYS else v for k, v in batch.items()
    }
    if "position_ids" not in batch:
        positions = local_positions(seq_len, cp_rank, cp, batch["input_ids"].device)
        out["position_ids"] = positions.expand(batch["input_ids"].shape[0], -1)
    if "label_mask" in batch:
        out[LABEL_COUNT_KEY] = batch["label_mask"].sum(dtype=torch.float32)
    return out
