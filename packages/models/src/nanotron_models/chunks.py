"""StageChunks: the v model chunks one pipeline rank runs under the interleaved 1F1B engine."""

from __future__ import annotations

from torch import nn

from .model import LlamaStage


class StageChunks(nn.Module):
    """This rank's v chunks (chunk c = virtual stage c * pp + pp_rank), registered under their
    global block names (`embedding`, `decoder.{i}`, ...) so parameter names match every other
    layout; `chunks` keeps the order the schedule runs them in. When the first and the last
    chunk both hold an end of a tied model (pp = 1), the lm_head is re-tied to the embedding.
    """

    def __init__(self, chunks: list[LlamaStage]) -> None:
        super().__init__()
        first, last = chunks[0], chunks[-1]
        if (
            len(chunks) > 1
            and hasattr(first, "embedding")
            and hasattr(last, "lm_head")
            and first.config.tie_word_embeddings
        ):
            last.lm_head.weight = first.embedding.weight
        self.config = first.config
        self.pc = first.pc
        self.chunks = list(chunks)  # a plain list: not registered twice
        self.block_names = [n for c in chunks for n in c.block_names]
        self.decoder = nn.ModuleDict()
        for chunk in chunks:
            for name in chunk.block_names:
                if name.startswith("decoder."):
                    self.decoder[name.split(".", 1)[1]] = chunk.block(name)
                else:
                    self.add_module(name, chunk.block(name))

    def forward(self, *args, **kwargs):
        raise RuntimeError("StageChunks are run chunk by chunk by the interleaved schedule")
