"""The learning-rate sweep's curves as an SVG (no plotting library in the environment): one
panel per parametrization, loss against log2(lr), one polyline per model size, a dot at each
curve's best rate. Used by bench/mup_lr_sweep.py."""

from __future__ import annotations

import math
from pathlib import Path

# (darkest last) one ramp per parametrization, so sizes read light -> dark as they grow
RAMPS = {
    "sp": ("#fcae91", "#fb6a4a", "#cb181d", "#67000d"),
    "mup": ("#9ecae1", "#4292c6", "#08519c", "#08306b"),
    "completep": ("#a1d99b", "#41ab5d", "#006d2c", "#00441b"),
}
PANEL_W, PANEL_H, PAD = 380, 260, 46


def best(losses: list[float]) -> int:
    """The index of the lowest finite loss (a diverged run is NaN)."""
    return min(range(len(losses)), key=lambda i: losses[i] if math.isfinite(losses[i]) else 1e9)


def _panel(
    title: str, ramp: tuple[str, ...], curves: dict[str, list[float]], lrs: list[float],
    lo: float, hi: float, ox: int, oy: int,
) -> list[str]:  # fmt: skip
    """One panel at (ox, oy): `curves` maps a size's label to its losses per rate."""
    x = lambda i: ox + PAD + i * (PANEL_W - 2 * PAD) / max(len(lrs) - 1, 1)  # noqa: E731
    y = lambda v: oy + PANEL_H - PAD - (min(v, hi) - lo) / (hi - lo) * (PANEL_H - 2 * PAD)  # noqa: E731
    out = [f'<text x="{ox + PAD}" y="{oy + 18}" font-weight="bold">{title}</text>']
    for i, lr in enumerate(lrs):
        out.append(
            f'<text x="{x(i):.0f}" y="{oy + PANEL_H - PAD + 14}" text-anchor="middle">'
            f"{int(math.log2(lr))}</text>"
        )
    out.append(
        f'<text x="{ox + PANEL_W / 2}" y="{oy + PANEL_H - PAD + 28}" text-anchor="middle">'
        "log2(learning rate)</text>"
    )
    for k in range(5):
        v = lo + k * (hi - lo) / 4
        out.append(f'<text x="{ox + PAD - 4}" y="{y(v) + 4:.0f}" text-anchor="end">{v:.2f}</text>')
    for n, (label, losses) in enumerate(curves.items()):
        colour = ramp[min(n + 4 - len(curves), 3)]
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(losses) if math.isfinite(v))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"/>')
        b = best(losses)
        if math.isfinite(losses[b]):
            out.append(f'<circle cx="{x(b):.1f}" cy="{y(losses[b]):.1f}" r="4" fill="{colour}"/>')
        out.append(
            f'<text x="{ox + PANEL_W - PAD}" y="{oy + 34 + 13 * n}" text-anchor="end" '
            f'fill="{colour}">{label}</text>'
        )
    return out


def write_svg(panels: list[tuple[str, str, dict[str, list[float]]]], lrs: list[float],
              ylabel: str, path: Path) -> None:  # fmt: skip
    """`panels`: (title, parametrization, {size label: losses}) each, two to a row. The
    panels share the loss axis; a diverged run (NaN) is left out, a loss far above the best
    is clipped to the top."""
    finite = [v for _, _, c in panels for ls in c.values() for v in ls if math.isfinite(v)]
    lo = math.floor(min(finite) * 10) / 10
    hi = min(max(finite), lo + 2.0)
    rows = (len(panels) + 1) // 2
    w, h = 2 * PANEL_W, rows * PANEL_H + 24
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="8" y="14">{ylabel}</text>',
    ]
    for k, (title, name, curves) in enumerate(panels):
        ox, oy = (k % 2) * PANEL_W, 20 + (k // 2) * PANEL_H
        out += _panel(title, RAMPS[name], curves, lrs, lo, hi, ox, oy)
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
