"""A deterministic synthetic token stream with learnable structure (Nanotron's dummy data).

Sample i is an arithmetic progression modulo the vocabulary, `(a + k*j) % vocab`, with start a
and stride k drawn from a generator seeded by (seed, i): the next token follows from the two
before it, so a model can learn it and the loss falls. The global batch of a step is samples
[consumed, consumed + global_batch); dp rank r takes its contiguous mbs*accum of them, so the
samples of a global batch never depend on dp.

With the model's document masking on (`documents=True`), a sample packs documents: lengths
drawn from the same seeded generator (1 to half the sample), each document its own progression,
with position ids restarting at each and the document ids the model's mask reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanotron_train.data.documents import DOCUMENT_IDS_KEY, document_ids, packed_positions

MAX_STRIDE = 8


def synthetic_sample(index: int, seed: int, length: int, vocab_size: int) -> torch.Tensor:
    """Sample `index` of the stream: `length` token ids (long)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    # tolist, not int(): the same draws without a scalar read per sample in the profile
    start = torch.randint(0, vocab_size, (1,), generator=g).tolist()[0]
    stride = torch.randint(1, MAX_STRIDE + 1, (1,), generator=g).tolist()[0]
    return (start + stride * torch.arange(length, dtype=torch.long)) % vocab_size


def synthetic_documents(index: int, seed: int, length: int, vocab_size: int):
    """Sample `index` as packed documents: token ids [length] and positions [length]."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    lengths: list[int] = []
    while sum(lengths) < length:
        high = max(1, length // 2)
        lengths.append(min(torch.randint(1, high + 1, (1,), generator=g).tolist()[0],
                           length - sum(lengths)))  # fmt: skip
    parts = []
    for n in lengths:
        start, stride = torch.randint(0, vocab_size, (2,), generator=g).tolist()
        parts.append((start + (1 + stride % MAX_STRIDE) * torch.arange(n)) % vocab_size)
    return torch.cat(parts), torch.from_numpy(packed_positions(lengths))


@dataclass
class SyntheticData:
    seed: int
    sequence_length: int
    vocab_size: int
    micro_batch_size: int
    accumulation: int
    dp_size: int
    dp_rank: int
    consumed_samples: int = 0
    documents: bool = False  # packed documents with positions and document ids

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.accumulation * self.dp_size

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This dp rank's micro-batches of the next global batch (advances the position)."""
        del step  # one stream for every step; the position is the consumed-sample count
        per_rank = self.micro_batch_size * self.accumulation
        first = self.consumed_samples + self.dp_rank * per_rank
        self.consumed_samples += self.global_batch_size
        out = []
        for m in range(self.accumulation):
            base = first + m * self.micro_batch_size
            if self.documents:
                out.append(self._documents(base))
                continue
            tokens = torch.stack(
                [
                    synthetic_sample(base + b, self.seed, self.sequence_length + 1, self.vocab_size)
                    for b in range(self.micro_batch_size)
                ]
            )
            out.append(
                {
                    "input_ids": tokens[:, :-1].contiguous(),
                    "label_ids": tokens[:, 1:].contiguous(),
                    "label_mask": torch.ones(
                        self.micro_batch_size, self.sequence_length, dtype=torch.bool
                    ),
                }
            )
        return out

    def _documents(self, base: int) -> dict[str, torch.Tensor]:
        S, n = self.sequence_length, self.micro_batch_size
        rows = [synthetic_documents(base + b, self.seed, S + 1, self.vocab_size) for b in range(n)]
        tokens = torch.stack([t for t, _ in rows])
        positions = torch.stack([p[:S] for _, p in rows])
        return {
            "input_ids": tokens[:, :-1].contiguous(),
            "label_ids": tokens[:, 1:].contiguous(),
            "label_mask": torch.ones(n, S, dtype=torch.bool),
            "position_ids": positions,
            DOCUMENT_IDS_KEY: torch.from_numpy(
                document_ids(np.ascontiguousarray(positions.numpy()))
            ),
        }

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
