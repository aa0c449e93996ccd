"""Context parallelism: activations saved for the backward per rank, at cp = 2 and 4 vs cp = 1.

The same Llama (fp32, GQA) and the same micro-batch of one sequence; each rank runs the
forward of its share (cp = 1: the whole sequence in one process; cp = 2, 4: gloo processes,
each holding 2 of the 2*cp chunks) while `saved_tensors_hooks` count the bytes autograd keeps
(each storage once, parameters excluded: the pipeline's ActivationTracker). Printed per cp:
the largest rank's bytes, its ratio to cp = 1's, and the aim 1/cp + 10%.

    .venv/bin/python bench/cp_memory.py [--seq 2048] [--hidden 256] [--layers 4]

The gathered keys and values of one layer exist only inside its attention's forward and
backward (they are not saved), so they are not in these figures; they are
2 * kv_heads / heads of one layer's query activations for the whole sequence.
"""

from __future__ import annotations

import argparse
import os

import torch

from nanotron_parallel.testing import run_distributed


def model_config(hidden: int, layers: int, seq: int):
    from nanotron_models.config import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=seq,
        tie_word_embeddings=True,
    )


def saved_bytes(seq: int, hidden: int, layers: int) -> int:
    """On every rank of a launch (or alone): bytes this rank's forward saves for backward."""
    from nanotron_models.model import build_llama
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.context_parallel import split_batch
    from nanotron_parallel.pipeline.step import ActivationTracker

    torch.set_num_threads(1)
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    pc = ParallelContext(cp=cp)
    try:
        stage = build_llama(model_config(hidden, layers, seq), pc, seed=1)
        stage.set_context_parallel(pc.cp_group, pc.cp_size)
        ids = torch.randint(0, 512, (1, seq + 1), generator=torch.Generator().manual_seed(2))
        batch = {
            "input_ids": ids[:, :-1],
            "label_ids": ids[:, 1:],
            "label_mask": torch.ones(1, seq, dtype=torch.bool),
        }
        tracker = ActivationTracker(stage, measure_bytes=True)
        loss = tracker.forward(stage, None, split_batch(batch, pc.cp_rank, pc.cp_size), 0)
        loss.backward()  # the graph is whole: everything counted is what the backward reads
        return tracker.stats.peak_saved_activation_bytes
    finally:
        pc.destroy()


def measure(cp: int, seq: int, hidden: int, layers: int) -> int:
    """The largest rank's saved bytes at context-parallel degree `cp`."""
    if cp == 1:
        return saved_bytes(seq, hidden, layers)
    return max(run_distributed(saved_bytes, cp, seq, hidden, layers, timeout=600))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    base = measure(1, args.seq, args.hidden, args.layers)
    print(
        f"sequence {args.seq}, hidden {args.hidden}, {args.layers} layers, 8 heads / 2 kv heads, "
        f"fp32, micro-batch 1"
    )
    print(f"cp=1: {base / 2**20:8.2f} MiB saved for backward per rank (reference)")
    for cp in (2, 4):
        got = measure(cp, args.seq, args.hidden, args.layers)
        aim = 1 / cp + 0.10
        print(
            f"cp={cp}: {got / 2**20:8.2f} MiB per rank (largest), ratio {got / base:.3f} "
            f"(aim <= 1/cp + 10% = {aim:.3f}: {'met' if got / base <= aim else 'MISSED'})"
        )


if __name__ == "__main__":
    main()
