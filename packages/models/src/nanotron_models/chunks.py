"""StageChunks: the v model chunks one pipeline rank runs under the interleaved 1F1B engine."""

from __future__ import annotations

from torch import nn

from .stage import ModelStage


class StageChunks(nn.Module):
    """This rank's v chunks (chunk c = virtual stage c * pp + pp_rank), registered under their
    global block names (`embedding`, `decoder.{i}`, ...) so parameter names match every other
    layout; `chunks` keeps the order the schedule runs them in. When the first and the last
    chunk both hold an end of a tied model (pp = 1), the lm_head is re-tied to the embedding.
    """

    def __init__(self, chunks: list[ModelStage]) -> None:
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
        # The layers' containers first (`decoder`), so parameters keep the order they had.
        for name in self.block_names:
            prefix = name.rpartition(".")[0]
            if prefix and prefix not in self._modules:
                self.add_module(prefix, nn.ModuleDict())
        for chunk in chunks:
            for name in chunk.block_names:
                self._register(name, chunk.block(name))

    def _register(self, name: str, block: nn.Module) -> None:
        """Add `block` under its global name: `decoder.3` as key "3" of a ModuleDict
        `decoder` (a module name cannot hold a dot), `embedding` as itself."""
        prefix, _, key = name.rpartition(".")
        if prefix:
            self._modules[prefix][key] = block
        else:
            self.add_module(name, block)

    def forward(self, *args, **kwargs):
        raise RuntimeError("StageChunks are run chunk by chunk by the interleaved schedule")
