"""One forward of a model split over pipeline stages (and interleaved virtual chunks): a
decoding step, or a whole sequence scored at once (inference/scoring.py).

Used by `decoding.generate` when a rank holds one stage (pp > 1) or StageChunks. Virtual stage
v (v = chunk * pp + pp_rank, the interleaved layout; one chunk per rank without interleaving)
runs on pp rank v % pp: each runs its blocks on the new positions with its own layers' part
of the decoding state (one per rank, the family's: a KV cache keyed by global layer index;
none when a whole sequence is scored) and sends the hidden state to the owner of v + 1 with the
pipeline's p2p `exchange` (from the last pp rank back to the first between interleaved
chunks). The last virtual stage, always on the last pp rank, gathers the logits over tp; what
it computes from them (the next tokens, or the scores of a batch) is broadcast over the pp
group so every rank of the replica continues with the same values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotron_parallel.pipeline.p2p import exchange


def stage_chunks(model) -> list:
    """This rank's stage chunks (ModelStage), in the order the schedule runs them."""
    return list(model.chunks) if hasattr(model, "chunks") else [model]


def pipelined_logits(model, new, positions=None, cache=None, key_mask=None):
    """Logits [b, s, vocab] of the new tokens `new` [b, s] on the last pp rank, None on the
    others; collective over the pp and tp groups. With `cache`, the caller commits the new
    tokens once this returns."""
    pc = model.pc
    chunks = stage_chunks(model)
    pp, me = pc.pp_size, pc.pp_rank
    n_virtual = len(chunks) * pp
    s = new.shape[1]
    batch = chunks[0].decoding_batch(new, positions, key_mask)
    x = None
    for v in range(n_virtual):
        if v % pp != me:
            continue
        if v > 0 and pp > 1:  # the hidden state of virtual stage v - 1
            x = exchange(src=pc.pp_ranks[(v - 1) % pp], group=pc.pp_group, device=pc.device)
        x = chunks[v // pp].decode_blocks(x, batch, cache)
        if v < n_virtual - 1 and pp > 1:
            exchange(send=x.contiguous(), dst=pc.pp_ranks[(v + 1) % pp], group=pc.pp_group)
    if me != pp - 1:
        return None
    return chunks[-1].gather_logits(x).transpose(0, 1)[:, :s]


def from_last_stage(pc, value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`value` (computed on the last pp rank) on every rank of the pp group; `like` gives the
    shape and dtype the other ranks receive into."""
    if pc.pp_size == 1:
        assert value is not None
        return value
    out = value if value is not None else torch.empty_like(like)
    dist.broadcast(out, src=pc.pp_ranks[-1], group=pc.pp_group)
    return out


def pipelined_step(model):
    """step(new [b, s], positions [b, s], cache, key_mask [b, cached + s], pick) -> tokens [b];
    `pick` maps the last position's logits [b, vocab] to token ids (on the last stage)."""
    pc = model.pc

    def step(new, positions, cache, key_mask, pick):
        logits = pipelined_logits(model, new, positions, cache, key_mask)
        cache.commit(new.shape[1])
        token = pick(logits[:, -1]) if logits is not None else None
        like = torch.empty(new.shape[0], dtype=torch.long, device=pc.device)
        return from_last_stage(pc, token, like)

    return step
