"""Deterministic blending: each sample comes from the dataset furthest below its share.

After ``n`` draws with counts ``c_d``, draw ``n+1`` goes to ``argmax_d (w_d * (n+1) - c_d)``
(ties to the lowest index). Every count stays within one sample of ``w_d * n``, no RNG is
needed, and the counts alone are the blend's position: resuming needs nothing else.
"""

from __future__ import annotations


def blend_draw(counts: list[int], weights: list[float], n: int) -> list[int]:
    """Draw ``n`` dataset indices, updating ``counts`` in place; returns the indices."""
    total = sum(counts)
    out: list[int] = []
    num = len(weights)
    if num == 1:
        counts[0] += n
        return [0] * n
    for _ in range(n):
        total += 1
        best, best_deficit = 0, weights[0] * total - counts[0]
        for d in range(1, num):
            deficit = weights[d] * total - counts[d]
            if deficit > best_deficit:
                best, best_deficit = d, deficit
        counts[best] += 1
        out.append(best)
    return out


def blend_counts_at(total: int, weights: list[float]) -> list[int]:
    """The per-dataset counts after ``total`` draws (replays the blend)."""
    counts = [0] * len(weights)
    blend_draw(counts, weights, total)
    return counts
