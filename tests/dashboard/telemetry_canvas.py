"""Reading what the telemetry pages drew on a canvas, for the browser tests of
test_browser_telemetry*.py: a pixel's colour and the colours the pages draw in."""

from __future__ import annotations

FORWARD, BACKWARD = (43, 125, 233), (233, 105, 43)
THIRD_KIND = (46, 157, 76)  # the third span kind to start in a timeline (#2e9d4c)
NEUTRAL = (255, 255, 191)  # the middle of the heatmap's scale: the interval's median
PIXEL = """([id, x, y]) => { const c = document.getElementById(id);
    return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3)); }"""


def near(rgb, want, tol=30):
    return all(abs(a - b) <= tol for a, b in zip(rgb, want))
