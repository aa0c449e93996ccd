"""A deterministic synthetic token stream with learnable structure (Nanotron's dummy data).

Sample i is an arithmetic progression modulo the vocabulary, `(a + k*j) % vocab`, with start a
and stride k drawn from a generator seeded by (seed, i): the next token follows from the two
before it, so a model can learn it and the loss falls. The global batch of a step is samples
[consumed, consumed + global_batch); dp rank r takes its contiguous mbs*accum of them, so the
samples of a global batch never depend on dp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_STRIDE = 8


def synthetic_sample(index: int, seed: int, length: int, vocab_size: int) -> torch.Tensor:
    """Sample `index` of the stream: `length` token ids (long)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    # tolist, not int(): the same draws without a scalar read per sample in the profile
    start = torch.randint(0, vocab_size, (1,), generator=g).tolist()[0]
    stride = torch.randint(1, MAX_STRIDE + 1, (1,), generator=g).tolist()[0]
    return (start + stride * torch.arange(length, dtype=torch.long)) % vocab_size


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

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
